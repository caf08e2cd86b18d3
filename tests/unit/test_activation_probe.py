"""runners/activation.py's saved-bytes counter on one process: what a forward saves for backward, each
storage once, parameters left out, one total per forward."""

import torch

from runners.activation import SavedBytes


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.exp(self.lin(x))  # linear saves x (and its weight: a parameter); exp saves its output
        a, b = y[:, :4], y[:, 4:]  # views of one storage, both saved by the product
        return (a * b).sum()


def test_saved_bytes_counts_each_storage_once_and_no_parameter():
    net = _Net()
    counter = SavedBytes(net)
    for rows in (3, 5):
        x = torch.randn(rows, 4, requires_grad=True)
        net(x).backward()
    counter.remove()
    # x (rows x 4) and y (rows x 8) in fp32; the weight and the two views of y add nothing.
    assert counter.per_forward == [4 * (3 * 4 + 3 * 8), 4 * (5 * 4 + 5 * 8)]
    net(torch.randn(2, 4, requires_grad=True)).backward()
    assert len(counter.per_forward) == 2  # removed: no more counting
