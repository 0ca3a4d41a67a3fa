import pytest
import torch

from shapecache.testing.models import SmallConvNet

pytest_plugins = ["pytester"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def conv_net():
    torch.manual_seed(0)
    return SmallConvNet().eval()
