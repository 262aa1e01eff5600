"""Issue 55: what the readers say about the files and paths around a draft, and the modes the
writer gives its files: a symlink loop named as one, a tensor in two shards named with both
files (`dspark inspect` exits 2 as generate refuses), weights as readable as their config."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from dspark.cli import main
from dspark.errors import FormatError
from dspark.formats.convert import write_speculators
from dspark.formats.load import load_spec
from safetensors.torch import load_file, save_file

from tests.tiny import tiny_draft, tiny_target


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    model = tiny_target(layers=2)
    draft = tiny_draft(model, gamma=3)
    path = tmp_path_factory.mktemp("paths") / "draft"
    write_speculators(draft.spec, draft.own_state_dict(), path)
    return path


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_convert_writes_the_weights_with_the_configs_mode(draft_dir, tmp_path, umask):
    old = os.umask(umask)
    try:
        assert main(["convert", str(draft_dir), str(tmp_path / "out"), "--to", "deepspec"]) == 0
    finally:
        os.umask(old)
    out = tmp_path / "out"
    assert _mode(out / "config.json") == 0o666 & ~umask
    assert _mode(out / "model.safetensors") == _mode(out / "config.json")  # not safetensors' private 0600


def test_a_symlink_loop_is_named_as_one(tmp_path, capsys):
    loop = tmp_path / "draft"
    loop.symlink_to(tmp_path / "other")
    (tmp_path / "other").symlink_to(loop)
    with pytest.raises(FormatError, match="is a symbolic link loop"):
        load_spec(loop)
    assert main(["inspect", str(loop)]) == 2
    err = capsys.readouterr().err
    assert "symbolic link loop" in err and "does not exist" not in err


def test_a_dangling_link_names_its_target_and_a_missing_path_does_not_exist(tmp_path):
    link = tmp_path / "draft"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(FormatError, match=r"is a symbolic link to .*gone, which does not exist"):
        load_spec(link)
    with pytest.raises(FormatError, match="nothing does not exist"):
        load_spec(tmp_path / "nothing")


def test_inspect_exits_2_on_shards_that_share_a_tensor_naming_both_files(draft_dir, tmp_path, capsys):
    tensors = load_file(str(draft_dir / "model.safetensors"))
    names = sorted(tensors)
    shared = names[len(names) // 2]
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2 + 1],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    out = tmp_path / "sharded"
    out.mkdir()
    (out / "config.json").write_text((draft_dir / "config.json").read_text())
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(out / file))
    weight_map = {k: f for f, keys in shards.items() for k in keys}  # the index names one file per tensor
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert main(["inspect", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"tensor {shared} is stored twice" in err
    assert "model-00001-of-00002.safetensors" in err and "model-00002-of-00002.safetensors" in err, err
    with pytest.raises(FormatError, match="stored twice"):  # what every decoding command reads it with
        load_spec(out)
