"""Supervised check: can the debug model learn reverse at all? Cross-entropy on the answer
tokens of all 125 words (batches of 256 sampled words), AdamW lr 7e-4; prints per-position greedy
accuracy (first, middle, last letter, EOS) every 50 steps.  .venv/bin/python bench/calibration/sl_reverse.py"""

import itertools
import time

import torch
import torch.nn.functional as F

from services.common.config import load_config
from services.common.tokenizer import build_char_tokenizer, eos_id
from trainer.model import build_model

torch.set_num_threads(1)
cfg = load_config("debug")
m = cfg.model
tok = build_char_tokenizer()
eos = eos_id(tok)
model = build_model(m, seed=0, init_std=cfg.trainer.init_std)
opt = torch.optim.AdamW(model.parameters(), lr=7e-4, betas=(0.9, 0.99), weight_decay=0.0)
words = ["".join(w) for w in itertools.product("abcde", repeat=3)]
seqs = []
for w in words:
    p = tok.encode(f"rev {w}:").ids
    a = tok.encode(w[::-1]).ids + [eos]
    seqs.append((p, a))
L = max(len(p) + len(a) for p, a in seqs)
X = torch.zeros(len(seqs), L, dtype=torch.long)
M = torch.zeros(len(seqs), L - 1)
for i, (p, a) in enumerate(seqs):
    s = p + a
    X[i, : len(s)] = torch.tensor(s)
    M[i, len(p) - 1 : len(s) - 1] = 1
t0 = time.time()
for step in range(1, 401):
    idx = torch.randint(0, len(seqs), (256,))
    x = X[idx]
    logits = model(x[:, :-1])
    lp = F.log_softmax(logits.float(), -1).gather(-1, x[:, 1:, None])[..., 0]
    loss = -(lp * M[idx]).sum() / M[idx].sum()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    if step % 50 == 0:
        with torch.no_grad():
            pred = model(X[:, :-1]).argmax(-1)
            acc = []
            for k in range(4):
                hits = [
                    pred[i, len(p) - 1 + k].item() == X[i, len(p) + k].item() for i, (p, a) in enumerate(seqs)
                ]
                acc.append(sum(hits) / len(hits))
        print(step, round(loss.item(), 3), [round(a, 2) for a in acc], f"{time.time() - t0:.0f}s", flush=True)
