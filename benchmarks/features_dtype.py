"""How far the default target's layer features computed in bf16 are from float32 ones (what a features dump stores).

    python benchmarks/features_dtype.py --dataset quickstart/data --samples 16 --layers 15

The first `--samples` training samples of a dataset, one forward each with the float32 target and with the
bf16 target; prints one JSON line: the relative error ‖bf16 − fp32‖ / ‖fp32‖ of the features (as the dump stores
them: cast to bf16), the same for the float32 features merely rounded to bf16 (the dump's storage error), and
the mean cosine similarity per token.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdraft.data.dataset import open_dataset  # noqa: E402
from flashdraft.target import load_target  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--layers", default="15")
    a = ap.parse_args()
    layers = [int(x) for x in a.layers.split(",")]
    ds = open_dataset(a.dataset, "train")
    fp32, bf16 = load_target("default", dtype="float32"), load_target("default", dtype="bfloat16")
    err, rounding, cos, norm, tokens = 0.0, 0.0, 0.0, 0.0, 0
    with torch.inference_mode():
        for i in range(a.samples):
            ids = torch.as_tensor(ds[i].input_ids, dtype=torch.long)[None]  # [1, S]
            ref = fp32.forward(ids, layer_ids=layers, logits="none").features[0]  # [S, k·H] float32
            low = bf16.forward(ids, layer_ids=layers, logits="none").features[0].float()
            err += float((low - ref).square().sum())
            rounding += float((ref.bfloat16().float() - ref).square().sum())
            norm += float(ref.square().sum())
            cos += float(torch.nn.functional.cosine_similarity(low, ref, dim=-1).sum())
            tokens += ref.shape[0]
    print(json.dumps({
        "samples": a.samples, "tokens": tokens, "layers": layers, "rel_err_bf16_target": round((err / norm) ** 0.5, 4),
        "rel_err_bf16_storage": round((rounding / norm) ** 0.5, 4), "mean_cosine": round(cos / tokens, 5),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
