"""torchvision's CIFAR10 reader that checks only that its files exist, not their md5 sums.

torchvision checks every batch and batches.meta against the official release's md5 sums,
which test fixtures and re-encoded copies cannot match. Machinery for `dataset.verify_checksums=false`,
not part of the fork surface: its own module, imported only by
`src.components.datasets.cifar10(verify_checksums=False)`, so torchvision stays out of start-up and
DataLoader workers can still unpickle the class by name.
"""

from torchvision.datasets import CIFAR10


class CIFAR10WithoutMD5(CIFAR10):
    # With md5 None, torchvision's integrity check is a file-exists check.
    train_list = [[name, None] for name, _ in CIFAR10.train_list]
    test_list = [[name, None] for name, _ in CIFAR10.test_list]
    meta = {**CIFAR10.meta, "md5": None}
