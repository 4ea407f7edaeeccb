"""Network presets into the environment, gloo pinned to loopback, the rendezvous store's address."""

import datetime
import os
from pathlib import Path

import pytest
import torch.distributed as dist

from ddp_plugins.app.config import compose_config, group_options
from ddp_plugins.lightning.network import apply_network_env, is_loopback, pin_gloo_to_loopback, restore_env
from ddp_plugins.testing import free_port

DOCUMENTED = {
    "default": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
    "infiniband": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_IB_TIMEOUT": "22", "NCCL_IB_RETRY_CNT": "7"},
    "tcp": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"},
    "debug": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "NCCL_DEBUG": "INFO"},
}
_ALL_PRESET_KEYS = sorted({key for env in DOCUMENTED.values() for key in env})


@pytest.mark.parametrize("preset", sorted(DOCUMENTED))
def test_network_preset_sets_exactly_its_variables_and_keeps_the_users(preset, monkeypatch):
    assert sorted(group_options("network")) == sorted(DOCUMENTED)
    env = compose_config([f"network={preset}"]).network.env
    for key in _ALL_PRESET_KEYS:  # setenv first so that monkeypatch restores what the preset sets
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    before = dict(os.environ)
    assert apply_network_env(env) == DOCUMENTED[preset]
    changed = {k: v for k, v in os.environ.items() if before.get(k) != v}
    assert changed == DOCUMENTED[preset] and set(before) <= set(os.environ)

    user_key = sorted(DOCUMENTED[preset])[-1]
    monkeypatch.setenv(user_key, "user-value")
    for key in DOCUMENTED[preset]:
        if key != user_key:
            monkeypatch.delenv(key)
    assert apply_network_env(env)[user_key] == "user-value" and os.environ[user_key] == "user-value"


def test_rendezvous_store_listens_on_every_interface_as_documented():
    """The module docstring says torch's TCPStore binds the wildcard address whatever MASTER_ADDR is."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10))
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if Path(table).exists():
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and local.endswith(f":{port:04X}"):
                    listening.append(local.split(":")[0])
    del store
    assert listening and all(set(address) == {"0"} for address in listening), listening


def test_restore_env_removes_added_and_restores_changed_variables(monkeypatch):
    monkeypatch.setenv("DDP_PLUGINS_KEPT", "user")
    monkeypatch.delenv("DDP_PLUGINS_ADDED", raising=False)
    before = dict(os.environ)
    apply_network_env({"DDP_PLUGINS_ADDED": 1})
    os.environ["DDP_PLUGINS_KEPT"] = "changed"
    restore_env(before)
    assert dict(os.environ) == before


@pytest.mark.parametrize(("address", "loopback"), [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                                   ("10.1.2.3", False), ("no-such-host.invalid", False)])  # fmt: skip
def test_loopback_addresses_are_recognized(address, loopback):
    assert is_loopback(address) is loopback


def test_gloo_is_pinned_to_loopback_only_for_a_loopback_main_address_and_never_over_the_user(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert pin_gloo_to_loopback("10.1.2.3") is None and "GLOO_SOCKET_IFNAME" not in os.environ
    assert pin_gloo_to_loopback("127.0.0.1") == "lo" and os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert pin_gloo_to_loopback("127.0.0.1") is None and os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
