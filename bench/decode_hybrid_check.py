"""Where the hybrid's static decoder departs from one full forward: each piece of the engine switched on alone.

    python3 bench/decode_hybrid_check.py [--dtype float32|bfloat16] [--device cuda] [--out FILE]

On the tiny Nemotron-H of the tests (core.tiny), the engine's `_Decoder` (prefill, then fixed random tokens fed
one at a time) is compared with one full forward over the same tokens (bench/gen_throughput.py's check), with the
CUDA graph, the engine's own attention kernel, the compiled norms and MLPs, and the Mamba kernels (PyTorch's or
mamba-ssm's Triton ones) each on or off. A row whose relative error is near the wrong-context error names the piece
that breaks the decoder.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from gen_throughput import check_static_decoder  # noqa: E402

from core import tiny  # noqa: E402
from core.chat import Message  # noqa: E402
from evals import decode_hybrid  # noqa: E402
from evals import generate as engine  # noqa: E402
from evals.generate import load  # noqa: E402
from evals.types import Item  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path)
    p.add_argument("--layers", action="append",
                   help="block types of the tiny hybrid, comma-separated (e.g. linear_attention,mlp); repeatable: "
                        "then only the graph rows run, one per pattern (which block breaks under the graph)")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hybrid-check-"))
    tok = tiny.build_tokenizer(root / "tokenizer")
    if args.layers:
        return by_layers(args, root, tok)
    path = tiny.build_model("nemotron_h", tok, root / "nemotron_h", seed=0)
    items = [Item(id=f"h{i}", messages=(Message(role="user", content="tell me " + "more " * i + "about 12 + 7"),))
             for i in range(8)]
    rows = []
    real_capture, real_kernels = engine._Decoder._capture, decode_hybrid.kernels_for
    triton_ok = args.device == "cuda" and decode_hybrid.kernels_for(torch.device("cuda")).name == "triton"
    for graph, own_attention, fuse, kernels in itertools.product(
            (False, True), (False, True), (False, True), ("torch", "triton") if triton_ok else ("torch",)):
        loaded = load(path, device=args.device, dtype=args.dtype)
        engine._Decoder._capture = real_capture if graph else (lambda self: None)
        decode_hybrid.kernels_for = real_kernels if kernels == "triton" else (lambda d: decode_hybrid.torch_kernels())
        init = engine._Decoder.__init__

        def patched(self, *a, _init=init, _own=own_attention, _fuse=fuse, **kw):
            kw.update(own_attention=_own, fuse=_fuse)
            _init(self, *a, **kw)

        engine._Decoder.__init__ = patched
        try:
            check = check_static_decoder(loaded, items)
        except Exception as err:  # noqa: BLE001 - a diagnostic: every row is reported
            check = {"error": f"{type(err).__name__}: {err}"[:300]}
        finally:
            engine._Decoder.__init__ = init
        row = {"graph": graph, "own_attention": own_attention, "fuse": fuse, "kernels": kernels} | check
        rows.append(row)
        print(json.dumps(row), flush=True)
    engine._Decoder._capture, decode_hybrid.kernels_for = real_capture, real_kernels
    if args.out:
        args.out.write_text(json.dumps({"dtype": args.dtype, "device": args.device, "rows": rows}, indent=2) + "\n")
    return 0


def _items() -> list[Item]:
    return [Item(id=f"h{i}", messages=(Message(role="user", content="tell me " + "more " * i + "about 12 + 7"),))
            for i in range(8)]


def by_layers(args, root: Path, tok: Path) -> int:
    """One tiny hybrid per block pattern; each decoded with the graph (as the engine does), and with the graph
    captured but the steps run eagerly (does capturing itself spoil the decoder's state?)."""
    real_config, real_capture = tiny._nemotron_h_config, engine._Decoder._capture
    rows = []
    for k, pattern in enumerate(args.layers):
        layers = pattern.split(",")

        def config(vocab, special, _layers=layers):
            c = real_config(vocab, special)
            c.layers_block_type = _layers
            c.num_hidden_layers = len(_layers)
            return c

        tiny._nemotron_h_config = config
        path = tiny.build_model("nemotron_h", tok, root / f"hybrid-{k}", seed=0)
        tiny._nemotron_h_config = real_config
        for mode in ("graph", "captured_then_eager"):
            def capture(self, _mode=mode):
                real_capture(self)
                if _mode == "captured_then_eager":
                    self.graph = None
            engine._Decoder._capture = capture
            loaded = load(path, device=args.device, dtype=args.dtype)
            try:
                check = check_static_decoder(loaded, _items())
            except Exception as err:  # noqa: BLE001 - a diagnostic: every row is reported
                check = {"error": f"{type(err).__name__}: {err}"[:300]}
            finally:
                engine._Decoder._capture = real_capture
            row = {"layers": pattern, "mode": mode} | check
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"dtype": args.dtype, "device": args.device, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
