"""A data set written from main.py's docstring alone, to hold the lesson to that contract (tests/test_lesson.py):
nothing of the project's dataset.py. Scenes of a square and a disc on noise, made from their index; the training
crop and flip drawn from (seed, epoch, index). With CONTRACT_CRASH="EPOCH N" set, the training sample after the N
first of that epoch in a worker fails, as a crash would: the test's interrupted run."""
import os

import numpy as np
import torch

NAMES = ["background", "square", "disc"]
SIZES = {"train": 24, "val": 5}  # 5 val images on 2 ranks: a sampler that pads would count one twice


def open_dataset(root, split, crop_size=None, seed=0, cache_dir=None, scale_range=(1.0, 1.0), color_jitter=0.0):
    """root, cache_dir, scale_range and color_jitter: no use here (the contract allows a data set to ignore them)."""
    return Shapes(split, crop_size, seed)


def scene(split, index):
    """(image uint8 (3, 40, 48), label uint8 (40, 48)): a square and a disc on noise; a border of 255 (no class)."""
    rng = np.random.default_rng([list(SIZES).index(split), index])
    image = rng.integers(0, 96, (40, 48, 3), dtype=np.uint8)
    label = np.zeros((40, 48), dtype=np.uint8)
    top, left = rng.integers(2, 20), rng.integers(2, 24)
    label[top:top + 14, left:left + 14] = 1
    rows, cols = np.mgrid[:40, :48]
    centre_row, centre_col = rng.integers(10, 30), rng.integers(10, 38)
    label[(rows - centre_row) ** 2 + (cols - centre_col) ** 2 < 49] = 2
    image[label == 1] += np.array([150, 40, 40], dtype=np.uint8)
    image[label == 2] += np.array([40, 40, 150], dtype=np.uint8)
    label[:, :1] = 255
    return torch.from_numpy(image).permute(2, 0, 1).contiguous(), torch.from_numpy(label)


class Shapes(torch.utils.data.Dataset):
    """Nothing public but what the contract names: a lesson that read more would fail."""

    def __init__(self, split, crop_size, seed):
        self._split, self._crop_size, self._seed = split, crop_size, seed
        self._fetched = 0  # training samples of the crash's epoch fetched in this process
        self.classes = {"names": NAMES}
        # The epoch in shared memory: persistent DataLoader workers see it change.
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    @property
    def epoch(self):
        return int(self._epoch)

    @epoch.setter
    def epoch(self, value):
        self._epoch.fill_(value)

    def __len__(self):
        return SIZES[self._split]

    def __getitem__(self, index):
        image, label = scene(self._split, index)
        if self._crop_size is None:
            return image, label
        crash = os.environ.get("CONTRACT_CRASH", "").split()
        if crash and int(crash[0]) == self.epoch:
            self._fetched += 1
            if self._fetched > int(crash[1]):
                raise RuntimeError(f"the test's crash in epoch {self.epoch}")
        height, width = self._crop_size
        draw = np.random.default_rng([self._seed, self.epoch, index])  # from (seed, epoch, index) alone
        top, left = draw.integers(0, 40 - height + 1), draw.integers(0, 48 - width + 1)
        image, label = image[:, top:top + height, left:left + width], label[top:top + height, left:left + width]
        if draw.random() < 0.5:
            image, label = image.flip(-1), label.flip(-1)
        return image.contiguous(), label.contiguous()
