"""A .pt2's weights are loaded as views of the file mapped copy-on-write (mopar.frontend.mapped):
the same values as torch's own load, in pages of the file, never written back to it."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.export.pt2_archive import _package

from mopar.frontend import load_model
from mopar.frontend.mapped import mapped_weights, release


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 32)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("mapped") / "scaled.pt2"
    torch.export.save(torch.export.export(_Scaled().eval(), (torch.randn(2, 64),)), str(path))
    return path


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def _in_file(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    address = tensor.untyped_storage().data_ptr()
    return any(start <= address < end for start, end in ranges)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_weights_are_the_files_pages_with_torchs_values(saved: Path) -> None:
    own = torch.export.load(str(saved))
    program = load_model(saved).exported
    assert program is not None
    ranges = _mapped_ranges(saved)
    assert ranges, "the archive is not mapped"
    for name, tensor in own.state_dict.items():
        assert torch.equal(program.state_dict[name], tensor), name
        assert _in_file(program.state_dict[name], ranges), f"{name} was copied, not mapped"
    x = torch.randn(2, 64)
    assert torch.equal(program.module()(x), own.module()(x))


def test_a_write_to_a_mapped_weight_never_reaches_the_file(saved: Path) -> None:
    before = _digest(saved)
    program = load_model(saved).exported
    assert program is not None
    weight = program.state_dict["fc.weight"]
    with torch.no_grad():
        weight.fill_(7.0)
    assert torch.all(weight == 7.0)
    assert _digest(saved) == before
    assert not torch.all(load_model(saved).exported.state_dict["fc.weight"] == 7.0)


def test_a_compressed_archive_is_read_as_torch_reads_it(saved: Path, tmp_path: Path) -> None:
    squeezed = tmp_path / "squeezed.pt2"
    with zipfile.ZipFile(saved) as src, zipfile.ZipFile(squeezed, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    with mapped_weights(squeezed) as mapped:
        program = torch.export.load(str(squeezed))
    assert not mapped
    assert not _mapped_ranges(squeezed)
    own = torch.export.load(str(saved))
    for name, tensor in own.state_dict.items():
        assert torch.equal(program.state_dict[name], tensor), name


def test_torchs_loader_is_its_own_again_after_the_load(saved: Path) -> None:
    before = _package._build_file_map
    with mapped_weights(saved) as mapped:
        assert mapped
        assert _package._build_file_map is not before
    assert _package._build_file_map is before
    with pytest.raises(RuntimeError), mapped_weights(saved):
        raise RuntimeError("a failed load")
    assert _package._build_file_map is before


def test_a_released_weight_keeps_its_values_and_a_plain_tensor_is_left_alone(saved: Path) -> None:
    program = load_model(saved).exported
    assert program is not None
    weight = program.state_dict["fc.weight"]
    before = weight.clone()
    with torch.no_grad():
        weight[0, 0] = 5.0  # a page written to is kept, not dropped
    assert release(weight)
    assert weight[0, 0] == 5.0
    assert torch.equal(weight[1:], before[1:])
    assert not release(before)
