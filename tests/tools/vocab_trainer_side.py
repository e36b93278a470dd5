"""Run in the trainers' venv (SpecForge, speculators and Model-Optimizer installed from the registry):
load `hsx vocab`'s files with SpecForge's and Model-Optimizer's own loaders and SpecForge's consistency
check, and rebuild them with speculators' and SpecForge's own builders from hsx's token_freq.pt. Usage: vocab_trainer_side.py DIR DRAFT_SIZE TARGET_SIZE"""

import sys
from collections import Counter
from types import SimpleNamespace

import numpy as np
import torch
from modelopt.torch.speculative.plugins.hf_eagle import HFEagleModel
from specforge.core.compact_teacher import validate_vocab_mapping_consistency
from specforge.data.preprocessing import process_token_dict_to_mappings
from specforge.modeling.draft import base as sf_base
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution


class Draft(torch.nn.Module):
    """The two buffers SpecForge's draft models register, in their dtypes and shapes."""

    def __init__(self, n: int, v: int) -> None:
        super().__init__()
        self.register_buffer("t2d", torch.ones(v, dtype=torch.bool))
        self.register_buffer("d2t", torch.zeros(n, dtype=torch.int64))


def main(d: str, n: int, v: int) -> None:
    draft = Draft(n, v)
    owner = next(c for c in vars(sf_base).values() if isinstance(c, type) and hasattr(c, "load_vocab_mapping"))
    owner.load_vocab_mapping(draft, f"{d}/vocab_mapping.pt")  # SpecForge's own loader
    validate_vocab_mapping_consistency(draft.t2d, draft.d2t)
    freq = torch.load(f"{d}/token_freq.pt", weights_only=True)
    d2t, t2d = build_vocab_mappings_from_distribution(freq, n, v)  # speculators' own builder
    assert torch.equal(d2t, torch.from_numpy(np.load(f"{d}/d2t.npy")))
    assert torch.equal(t2d, torch.from_numpy(np.load(f"{d}/t2d.npy")))
    assert torch.equal(d2t, draft.d2t) and torch.equal(t2d, draft.t2d)
    # Model-Optimizer's data.draft_vocab_cache: its own loader checks shape and dtype, then copies.
    modelopt = SimpleNamespace(eagle_config=SimpleNamespace(draft_vocab_size=n, vocab_size=v),
                               eagle_module=SimpleNamespace(d2t=torch.zeros(n, dtype=torch.int64)))
    HFEagleModel.load_draft_vocab_cache(modelopt, f"{d}/d2t.pt")
    assert torch.equal(modelopt.eagle_module.d2t, draft.d2t)
    # SpecForge's builder breaks frequency ties in its own order: the same counts are chosen.
    _, sf_t2d = process_token_dict_to_mappings(Counter(freq), n, v)
    ours = sorted(freq.get(t, 0) for t in torch.nonzero(draft.t2d).flatten().tolist())
    theirs = sorted(freq.get(t, 0) for t in torch.nonzero(sf_t2d).flatten().tolist())
    assert ours == theirs, "SpecForge's builder chooses tokens of other frequencies"
    print("OK: SpecForge's and Model-Optimizer's loaders accept the files; speculators' builder gives the same d2t/t2d")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
