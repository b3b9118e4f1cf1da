"""What a drafter predicts slot by slot, teacher-forced on a dataset's eval split: per-slot accuracy,
the chain streak histogram, and the most common predictions at the far slots — an under-trained
drafter's far slots collapse onto frequent tokens ('.', newline, ...).

    python benchmarks/slot_predictions.py --drafter models/smollm2-135m-instruct-dflash-b16 \
        --dataset benchmarks/results/…/data_eval --samples 4 --stride 7

One target pass per sample (first --max-tokens tokens) gives the context features; a drafter block
is run at every --stride-th response position (block = [x[a], MASK × (B−1)] at positions a.., context
rows < a), exactly as training and decoding build it.
"""

from __future__ import annotations

import argparse
import collections

import torch

from flashdraft.data.dataset import open_dataset
from flashdraft.drafter import DFlashDrafter
from flashdraft.target import check_pair, load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--dataset", required=True, help="a flashdraft dataset folder (its eval split is read)")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--stride", type=int, default=7, help="every n-th response position is an anchor")
    ap.add_argument("--max-tokens", type=int, default=700)
    ap.add_argument("--far-from", type=int, default=4, help="slots >= this count as far")
    args = ap.parse_args()

    target = load_target(args.target, dtype=torch.float32, device="cpu")
    drafter = DFlashDrafter.from_pretrained(args.drafter, dtype=torch.float32).eval()
    check_pair(target, drafter.config)
    cfg = drafter.config
    b, mask_id = cfg.block_size, cfg.mask_token_id
    hits = torch.zeros(b - 1)
    rounds = 0
    streaks: collections.Counter[int] = collections.Counter()
    far: collections.Counter[int] = collections.Counter()
    ds = open_dataset(args.dataset, "eval")
    for i in range(min(args.samples, len(ds))):
        s = ds[i]
        ids = torch.tensor(s.input_ids[: args.max_tokens], dtype=torch.long)[None]  # [1, n]
        first = int(s.loss_mask.argmax())
        with torch.no_grad():
            feats = target.forward(ids, layer_ids=cfg.target_layer_ids, logits="none").features  # [1, n, k·H]
            for a in range(first + 1, ids.shape[1] - b, args.stride):
                block = torch.full((1, b), mask_id)
                block[0, 0] = ids[0, a]
                pos = torch.arange(a + b)[None]  # context rows 0..a-1, then the block at a..a+B-1
                hidden = drafter(feats[:, :a], target.embed_tokens(block), pos)  # [1, B, H]
                pred = target.lm_head(hidden)[0, 1:].argmax(-1)  # [B-1] slots 1..B-1
                ok = pred == ids[0, a + 1 : a + b]
                hits += ok.float()
                rounds += 1
                streaks[int(ok.long().cumprod(0).sum())] += 1
                far.update(int(t) for t in pred[args.far_from - 1 :])
    tok = target.tokenizer
    print(f"{rounds} blocks from {min(args.samples, len(ds))} samples")
    print("per-slot accuracy:", " ".join(f"{float(x):.2f}" for x in hits / max(rounds, 1)))
    print("chain streak (accepted drafts) histogram:", dict(sorted(streaks.items())))
    total = sum(far.values())
    common = ", ".join(f"{tok.decode([t])!r} {c / total:.0%}" for t, c in far.most_common(8))
    print(f"most common predictions at slots >= {args.far_from}: {common}")


if __name__ == "__main__":
    main()
