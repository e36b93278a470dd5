"""`hsx vocab`'s choice of draft tokens as a pure function, and its files as SpecForge and
speculators load them. Neither trainer is installed here, so their loading code's steps are done
as their code does them (SpecForge 2026-08, specforge/modeling/draft/base.py load_vocab_mapping:
torch.load, then copy_ into a bool [V] t2d and an int64 [N] d2t buffer; speculators 2026-08,
scripts/train.py _load_mappings: np.load of d2t.npy/t2d.npy, then model.load_vocab_mappings'
checks: t2d.shape[0] == verifier vocab, t2d.sum() == draft vocab, d2t.shape[0] == draft vocab)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from hsx_extractor.config import OutputSpec
from hsx_extractor.storage.store import open_store
from hsx_extractor.tools.cli import main
from hsx_extractor.tools.vocab import VocabError, draft_tokens, vocab_mapping, write_vocab
from tests.storage.samples import finalize_run, plan_for, write_run
from tests.trainers.trainers_venv import is_built, venv_dir, venv_python


def test_most_frequent_first_ties_to_the_lower_id() -> None:
    counts = {9: 5, 4: 5, 7: 9, 2: 1, 30: 5}
    assert draft_tokens(counts, 3, 40).tolist() == [4, 7, 9]  # 7 (9), then 4 and 9 beat 30 on the tie
    d2t, t2d = vocab_mapping(counts, 3, 40)
    assert d2t.dtype == np.int64 and d2t.tolist() == [4 - 0, 7 - 1, 9 - 2]
    assert t2d.dtype == np.bool_ and t2d.shape == (40,) and np.flatnonzero(t2d).tolist() == [4, 7, 9]
    assert (np.arange(3) + d2t).tolist() == np.flatnonzero(t2d).tolist()


def test_fewer_counted_tokens_than_the_draft_vocab_fill_with_the_lowest_unused_ids() -> None:
    assert draft_tokens({5: 3, 1: 1}, 4, 10).tolist() == [0, 1, 2, 5]
    assert draft_tokens({}, 2, 10).tolist() == [0, 1]


@pytest.mark.parametrize(("counts", "n", "v"), [({1: 1}, 0, 10), ({1: 1}, 11, 10), ({10: 1}, 2, 10)])
def test_sizes_that_do_not_fit_are_refused(counts: dict[int, int], n: int, v: int) -> None:
    with pytest.raises(VocabError):
        vocab_mapping(counts, n, v)


def _finished_run(tmp_path: Path, vocab_size: int | None) -> str:
    store = open_store(OutputSpec.model_validate({"uri": str(tmp_path / "out")}), "run-1")
    write_run(store, plan_for(9, 4))
    finalize_run(store, {"model": "tiny", "vocabSize": vocab_size})
    return str(tmp_path / "out" / "run-1")


def test_files_load_as_specforge_and_speculators_load_them(tmp_path: Path) -> None:
    uri = _finished_run(tmp_path, 32000)  # samples.record draws ids below 32000
    summary = write_vocab(uri, 32, tmp_path / "v")
    assert summary["targetVocabSize"] == 32000 and summary["draftVocabSize"] == 32
    assert summary["distinctTokens"] > 32  # some counted tokens are left out
    # SpecForge: the draft model's buffers, then load_vocab_mapping.
    t2d_buffer = torch.ones(32000, dtype=torch.bool)
    d2t_buffer = torch.zeros(32, dtype=torch.int64)
    mapping = torch.load(tmp_path / "v" / "vocab_mapping.pt", weights_only=True)
    t2d_buffer.copy_(mapping["t2d"])
    d2t_buffer.copy_(mapping["d2t"])
    assert mapping["t2d"].dtype == torch.bool and mapping["d2t"].dtype == torch.int64
    selected = torch.nonzero(t2d_buffer).flatten()  # SpecForge's consistency rule
    assert selected.tolist() == (d2t_buffer + torch.arange(32)).tolist()
    # speculators: np.load, torch.from_numpy, load_vocab_mappings' checks.
    d2t = torch.from_numpy(np.load(tmp_path / "v" / "d2t.npy"))
    t2d = torch.from_numpy(np.load(tmp_path / "v" / "t2d.npy"))
    assert t2d.shape[0] == 32000 and int(t2d.sum(dtype=torch.long)) == 32 and d2t.shape[0] == 32
    assert torch.equal(d2t, mapping["d2t"]) and torch.equal(t2d, mapping["t2d"])
    freq = torch.load(tmp_path / "v" / "token_freq.pt", weights_only=True)
    assert sum(freq.values()) == summary["maskedTokens"] and len(freq) == summary["distinctTokens"]
    chosen = set(selected.tolist())  # the most frequent: nothing left out is counted more often
    assert min(freq[t] for t in chosen) >= max(n for t, n in freq.items() if t not in chosen)


def test_cli_needs_the_target_vocab_when_the_manifest_lacks_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri = _finished_run(tmp_path, None)
    assert main(["vocab", uri, "--draft-vocab-size", "8", "--out", str(tmp_path / "v")]) != 0
    assert "--target-vocab-size" in capsys.readouterr().err
    assert main(["vocab", uri, "--draft-vocab-size", "8", "--out", str(tmp_path / "v"), "--target-vocab-size", "32000"]) == 0
    assert np.load(tmp_path / "v" / "t2d.npy").shape == (32000,)
    assert main(["vocab", str(tmp_path / "out" / "nothing"), "--draft-vocab-size", "8"]) != 0
    assert "no manifest" in capsys.readouterr().err


# The trainers' venv (SpecForge, speculators from the registry) that make test-tools builds under HSX_CACHE.
@pytest.mark.skipif(not is_built(), reason=f"the trainers venv is not built at {venv_dir()} (make test-tools)")
def test_real_specforge_and_speculators_load_the_files(tmp_path: Path) -> None:
    uri = _finished_run(tmp_path, 32000)
    write_vocab(uri, 64, tmp_path / "v")
    side = Path(__file__).with_name("vocab_trainer_side.py")
    done = subprocess.run([str(venv_python()), str(side), str(tmp_path / "v"), "64", "32000"],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0 and "OK:" in done.stdout, done.stdout + done.stderr
