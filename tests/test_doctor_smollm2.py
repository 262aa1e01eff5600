"""Issue 14 on the real target: the bundled SmolLM2 draft is a weak draft (acceptance length about
1.6-1.7), and its layout lie (`sample_from_anchor: false` with block_size + 1: a consistent file)
costs only about 6% of the tokens per step. The doctor must still catch it with its default
settings, and call the true file healthy."""

import json
import logging

import pytest
from dspark.api import BUNDLED_DRAFT, load_engine
from dspark.cli import main
from dspark.doctor.report import EXIT_UNHEALTHY

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lie(tmp_path_factory):
    path = tmp_path_factory.mktemp("bundled-lie")
    config = json.loads((BUNDLED_DRAFT / "config.json").read_text())
    assert config["sample_from_anchor"] is True and config["block_size"] == 3
    config["sample_from_anchor"], config["block_size"] = False, 4  # speculative_tokens stays 3: consistent
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").symlink_to(BUNDLED_DRAFT / "model.safetensors")
    return str(path)


def test_doctor_catches_the_layout_lie_of_the_weak_bundled_draft(lie, capsys):
    assert main(["doctor", "--draft", lie, "--json"]) == EXIT_UNHEALTHY
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "misread" and out["explained_by"].startswith("anchor-first"), out["diagnoses"]
    assert len(out["diagnoses"]) == 1
    assert "set sample_from_anchor: true, block_size: 3 and speculative_tokens: 3" in out["diagnoses"][0]


def test_doctor_calls_the_bundled_draft_healthy(capsys):
    assert main(["doctor", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"] == "healthy" and not out["diagnoses"]
    assert 1.3 < out["readings"][0]["accept_length"] < 2.0  # a trained draft's, far from a random one's 1.0


def test_load_time_check_warns_on_the_lie_only(lie, caplog):
    with caplog.at_level(logging.INFO, logger="dspark"):
        load_engine("smollm2", lie)
    warned = [r.getMessage() for r in caplog.records if "LIKELY MISREAD" in r.getMessage()]
    assert len(warned) == 1 and "sample_from_anchor: true" in warned[0]
    assert any("load-time draft check:" in r.getMessage() for r in caplog.records)  # its cost is stated
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dspark"):
        load_engine("smollm2")
    assert not [r for r in caplog.records if "LIKELY MISREAD" in r.getMessage()]
