"""Demo data: the digits bundled with scikit-learn, and a synthetic set of any size."""

from __future__ import annotations

import multiprocessing

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from ddp_plugins.core.checks import check_int, check_number
from ddp_plugins.core.process import start_forkserver


def _worker_context() -> multiprocessing.context.BaseContext:
    """Start loader workers from a forkserver, not by forking a rank (its threads' locks; see docs/design.md)."""
    context = multiprocessing.get_context("forkserver")
    # not the main module: workers re-run it as __mp_main__, and preloaded it warns "found in sys.modules"
    context.set_forkserver_preload(["torch", "ddp_plugins.core.workers"])
    return context


class _TensorDataModule(pl.LightningDataModule):
    """Train/validation split of in-memory tensors, the same on every rank (fixed split seed)."""

    num_samples: int  # rows of the data, known without loading them

    def __init__(self, batch_size: int = 32, val_fraction: float = 0.2, num_workers: int = 0, split_seed: int = 0):
        super().__init__()
        check_int("batch_size", batch_size, 1)
        check_int("num_workers", num_workers, 0)
        check_number("val_fraction", val_fraction, 0, 1, exclusive_minimum=True, exclusive_maximum=True)
        check_int("split_seed", split_seed, 0)
        self.batch_size, self.val_fraction = batch_size, val_fraction
        self.num_workers, self.split_seed = num_workers, split_seed
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @property
    def train_rows(self) -> int:
        """Rows of the training split, known without loading the data (what a global batch is checked against)."""
        return self.num_samples - int(round(self.num_samples * self.val_fraction))

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if self.num_workers > 0:
            _worker_context()
            start_forkserver()
        x, y = self._tensors()
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.split_seed))
        n_val = int(round(len(x) * self.val_fraction))
        val, train = order[:n_val], order[n_val:]
        self.train_set = TensorDataset(x[train], y[train])
        self.val_set = TensorDataset(x[val], y[val])

    def _loader(self, dataset: TensorDataset | None, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"Call `{type(self).__name__}.setup()` before asking for a dataloader.")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            multiprocessing_context=_worker_context() if self.num_workers > 0 else None,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    test_dataloader = predict_dataloader = val_dataloader  # the validation split serves all three


class DigitsDataModule(_TensorDataModule):
    """scikit-learn's bundled 8x8 digits (1797 images, 10 classes), scaled to [0, 1].

    Example::

        >>> dm = DigitsDataModule(batch_size=16)
        >>> dm.setup()
        >>> len(dm.train_set), len(dm.val_set), dm.train_rows
        (1438, 359, 1438)
    """

    num_classes = 10
    num_samples = 1797  # load_digits()'s images

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        return x, torch.tensor(digits.target, dtype=torch.long)


class SyntheticDataModule(_TensorDataModule):
    """Random images with a learnable class signal, of a configurable size (for benchmarks).

    Example::

        >>> dm = SyntheticDataModule(num_samples=100, image_size=8)
        >>> dm.setup()
        >>> tuple(dm.train_set[0][0].shape), len(dm.train_set) == dm.train_rows
        ((1, 8, 8), True)
    """

    def __init__(
        self, num_samples: int = 4096, num_classes: int = 10, image_size: int = 8, data_seed: int = 0, **kwargs
    ):
        super().__init__(**kwargs)
        check_int("num_samples", num_samples, 1)
        check_int("num_classes", num_classes, 2)
        check_int("image_size", image_size, 4)
        check_int("data_seed", data_seed, 0)
        self.num_samples, self.num_classes = num_samples, num_classes
        self.image_size, self.data_seed = image_size, data_seed

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.data_seed)
        y = torch.randint(self.num_classes, (self.num_samples,), generator=gen)
        prototypes = torch.randn(self.num_classes, 1, self.image_size, self.image_size, generator=gen)
        noise = torch.randn(self.num_samples, 1, self.image_size, self.image_size, generator=gen)
        return prototypes[y] + 0.5 * noise, y
