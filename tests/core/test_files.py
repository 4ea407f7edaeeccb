import pytest

from ddp_plugins.core.checkpoints import remove_stale_temporaries
from ddp_plugins.core.checks import ArgumentValueError
from ddp_plugins.core.files import open_atomic, write_text_atomic


def test_a_failure_inside_the_block_or_before_the_rename_leaves_the_old_file_alone(tmp_path):
    target = tmp_path / "metrics.csv"
    write_text_atomic(target, "step\r\n0\r\n")
    assert target.read_bytes() == b"step\r\n0\r\n", "newlines are written as given"
    with pytest.raises(RuntimeError, match="mid-write"), open_atomic(target, "w") as file:
        file.write("half")
        raise RuntimeError("mid-write")

    def refuse(tmp):
        assert tmp.read_text() == "whole", "before_rename sees the complete temporary file"
        raise OSError("digest failed")

    with pytest.raises(OSError, match="digest failed"), open_atomic(target, "w", before_rename=refuse) as file:
        file.write("whole")
    assert target.read_bytes() == b"step\r\n0\r\n", "the previous file is untouched"
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.csv"], "no temporary file left behind"


def test_only_write_modes_are_accepted_and_a_killed_writers_temporary_is_recognised(tmp_path):
    with pytest.raises(ArgumentValueError, match="`mode` should be one of 'wb', 'w', got 'a'"):
        with open_atomic(tmp_path / "x", "a"):
            pass
    (tmp_path / ".step-3.ckpt.4242.tmp").write_bytes(b"partial")
    assert [p.name for p in remove_stale_temporaries(tmp_path)] == [".step-3.ckpt.4242.tmp"]
