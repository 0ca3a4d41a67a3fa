import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


class SmallConvNet(torch.nn.Module):
    """Two convolutions and a nonlinearity: shape-polymorphic, like a tiny UNet block."""

    def __init__(self, channels: int = 3, hidden: int = 8):
        super().__init__()
        self.conv_in = torch.nn.Conv2d(channels, hidden, 3, padding=1)
        self.conv_out = torch.nn.Conv2d(hidden, channels, 3, padding=1)

    def forward(self, x, scale: float = 1.0):
        return self.conv_out(torch.nn.functional.silu(self.conv_in(x))) * scale


@pytest.fixture
def conv_net():
    torch.manual_seed(0)
    return SmallConvNet().eval()


# Five or more distinct (height, width) sizes, as a diffusion service sees them.
SIZES = [(8, 8), (8, 12), (12, 8), (16, 16), (16, 24), (24, 16)]


pytest_plugins = ["pytester"]
