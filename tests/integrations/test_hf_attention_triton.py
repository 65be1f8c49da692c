"""``"mmbalance_varlen"`` on the Triton path: tiny Llama, Gemma2 (softcap and sliding window) and
gpt-oss (sinks and sliding window) models, two packed rows with sequences longer than the windows,
under the interpreter.

``TRITON_INTERPRET`` is read at import, so the model runs in a fresh process with it set (the
kernel tests cover the kernels themselves; this checks the backend's calls reach them and give
eager's logits and gradients, sequence by sequence).
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", minversion="5.6")

from mmbalance.kernels import _launch  # noqa: E402
from tests import procs  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import copy, sys, torch, transformers
    from tests.integrations import test_hf_attention_zoo as zoo
    from mmbalance.kernels import _launch
    from mmbalance.integrations.hf import register_attention
    assert _launch.INTERPRET
    import mmbalance.integrations.hf.attention.backend as attn
    used = []
    real = attn.attention_block
    def spy(*a, **k):
        used.append(k.get("backend", "auto"))
        return real(*a, **k)
    attn.attention_block = spy
    name = register_attention()
    for family in sys.argv[1:]:
        cfg, cls = getattr(zoo, "_" + family)()
        torch.manual_seed(0)
        ref = cls._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
        mine = cls._from_config(copy.deepcopy(cfg), attn_implementation=name).eval()
        mine.load_state_dict(ref.state_dict())
        rows = [[3, 5], [6, 1, 1]]
        g = torch.Generator().manual_seed(1)
        seqs = [[torch.randint(3, 64, (n,), generator=g) for n in r] for r in rows]
        ids = torch.stack([torch.cat(r) for r in seqs])
        pos = torch.stack([torch.cat([torch.arange(len(s)) for s in r]) for r in seqs])
        w = torch.randn(*ids.shape, 64, generator=g)
        used.clear()
        out = mine(input_ids=ids, position_ids=pos, use_cache=False).logits
        (out * w).sum().backward()
        want = []
        for r, row in enumerate(seqs):
            at = 0
            for s in row:
                lg = ref(input_ids=s[None], use_cache=False).logits[0]
                (lg * w[r, at:at + len(s)]).sum().backward()
                want.append(lg)
                at += len(s)
        torch.testing.assert_close(out.reshape(-1, 64), torch.cat(want), rtol=1e-4, atol=1e-4)
        for (n, a), (_, b) in zip(mine.named_parameters(), ref.named_parameters()):
            if b.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-4,
                                           msg=lambda m, n=n: family + " " + n + ": " + m)
        assert used, family + ": the backend never called the op"
    print("TRITON-PATH-OK")
    """
)


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available() or _launch.INTERPRET, reason="runs the interpreter in a fresh process"
)
def test_packed_models_on_the_triton_path():
    env = dict(os.environ, TRITON_INTERPRET="1", MMBALANCE_ATTN_BACKEND="triton", PYTHONDONTWRITEBYTECODE="1")
    proc = procs.run(
        [sys.executable, "-c", SCRIPT, "llama", "gemma2", "gpt_oss"], cwd=REPO, env=env, timeout=600
    )
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0 and "TRITON-PATH-OK" in proc.stdout, tail
