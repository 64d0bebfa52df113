"""``load_into`` copies: what a module keeps of the values it is handed must not view the
file, which the next save to the same path rewrites (and a truncation would crash)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import ckpt_tools as ct


class _Stats(nn.Module):
    """Keeps the tensor ``set_extra_state`` gets, as fp8 scaling statistics do."""

    def __init__(self) -> None:
        super().__init__()
        self.amax = torch.zeros(4)

    def get_extra_state(self) -> dict[str, torch.Tensor]:
        return {"amax": self.amax}

    def set_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        self.amax = state["amax"]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)  # 16 KiB before the statistics in the file
        self.stats = _Stats()
        self.ref = torch.ao.nn.quantized.reference.Linear(
            4,
            4,
            weight_qparams={
                "qscheme": torch.per_channel_affine,
                "dtype": torch.quint8,
                "scale": torch.full((4,), 0.1),
                "zero_point": torch.zeros(4, dtype=torch.int),
                "axis": 0,
            },
        )


def test_values_a_module_keeps_do_not_change_when_the_file_is_saved_again(tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    saved = _Net()
    saved.stats.amax = torch.tensor([1.0, 2.0, 3.0, 4.0])
    torch.save(saved.state_dict(), path)
    oracle = _Net()
    oracle.load_state_dict(torch.load(path, weights_only=True))
    model = _Net()
    ct.load_into(model, path)
    nxt = _Net()
    nxt.stats.amax = torch.full((4,), 7.0)
    with torch.no_grad():
        nxt.ref.weight_scale.fill_(9.0)  # (torch's reference module sets it with setattr)
        nxt.lin.weight.fill_(5.0)
    torch.save(nxt.state_dict(), path)  # the next checkpoint, to the same path
    path.write_bytes(b"")  # (a save in progress: a view of it would now crash the process)
    for name, want in oracle.state_dict().items():
        got = model.state_dict()[name]
        if name.endswith("_extra_state"):
            got, want = got["amax"], want["amax"]
        assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want, name
    assert torch.equal(model.stats.amax, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch.equal(model.ref.weight_scale, torch.full((4,), 0.1))
