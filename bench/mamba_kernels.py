"""Nemotron-H training on mamba-ssm's Triton SSD kernels (trainers/mamba_kernels.py) against transformers'
pure-torch fallback, packing against padding, and grouped against looped experts, in one run on one GPU.

Model: the hybrid bench shape (bench/gen_throughput.py's nemotron-h: 18 blocks "MEME*E" x 3 of Mamba-2, MoE and
attention, hidden 2048, 64 Mamba heads of 64, state 128, 8 groups, chunk 128, 16 experts top-4), vocabulary
1024 (core.tiny's tokenizer), random initialisation (throughput depends on shapes, not weights).

Checks before the timing (failures are listed in the JSON's `failures` and printed; the timing still runs, as
one call of device time has to hold everything):
- one mixer, bf16, fresh random input: output and gradients (input and every parameter) of the Triton path
  against transformers' fallback run on an fp32 copy, as ||x - ref|| / ||ref||;
- the whole model in fp32, batch 1 x 4096: loss and every parameter's gradient, Triton path against fallback;
- packing, whole model in fp32: rows of 700, 1300, 96 and 1900 tokens packed into one 4096 sequence with
  trainers.batch.pack_batch(seq_idx=True) give the per-token log-probabilities and gradients of the rows run
  one at a time (and without seq_idx they do not).

Timed (bf16 weights, AdamW, one optimizer step per micro-batch; median of the timed steps after warm-up):
- `fallback`: transformers' mixer (no kernels), grouped experts (transformers' default);
- `triton`: the project's path, Triton SSD mixers, grouped experts;
- `triton-eager-moe`: Triton SSD mixers, transformers' expert loop (`experts_implementation="eager"`);
- packing: SFT-like rows of 150..2000 tokens, padded micro-batches of 4 rows against packs of <= 4096 tokens
  (2 per micro-batch), real (non-padding) tokens/s, both on the Triton path;
- `moe-layer` (asked for by name): one MoE block, 8192 tokens, forward + backward, transformers' grouped
  expert products against its loop over experts.
MFU = model FLOPs per token x tokens/s over the bf16 8192^3 matmul rate measured in the same run; model FLOPs per
token as bench/train_throughput.py counts them: 6 x active parameters (routed experts at top-k / experts) +
6 x attention layers x seq x attention width.

GPU (one H200; mamba-ssm as a pure-python wheel, transformers 5.24 and pydantic carried in bench/.wheels/h8,
installed with pip --target into /tmp/site; the last command runs under the image's own transformers 5.17, the
wheels but transformers in /tmp/s517):

    PYTHONPATH=/tmp/site python3 bench/mamba_kernels.py --out bench/results/mamba_kernels-h200.json
    PYTHONPATH=/tmp/site python3 bench/mamba_kernels.py --parts moe-layer \
        --out bench/results/mamba_kernels-h200-moe-layer.json
    PYTHONPATH=/tmp/s517 python3 bench/mamba_kernels.py --parts fallback \
        --out bench/results/mamba_kernels-h200-fallback-tf517.json

CPU smoke of the script itself (minutes on 2 cores; figures meaningless):

    .venv/bin/python bench/mamba_kernels.py --smoke --out /tmp/mamba_kernels-smoke.json
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from any directory

from trainers import mamba_kernels  # noqa: E402
from trainers.batch import Encoded, pack_batch, pack_rows, pad_batch  # noqa: E402
from trainers.losses import token_logprobs  # noqa: E402

VOCAB = 1024
# --smoke (CPU, a tiny shape, the torch reference scan in place of the Triton kernels) exercises this script's
# code without a GPU; its figures mean nothing.
SMOKE = {"hidden_size": 64, "hybrid_override_pattern": "ME*E", "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "intermediate_size": 128, "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16,
         "n_groups": 2, "chunk_size": 16, "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32}
DEV = {"device": torch.device("cuda"), "smoke": False}


def sync() -> None:
    if DEV["device"].type == "cuda":
        torch.cuda.synchronize()


def use_kernels(model) -> int:
    return (mamba_kernels.use_reference_ssd if DEV["smoke"] else mamba_kernels.use_triton_ssd)(model)


def hybrid_config(**overrides):
    from transformers import NemotronHConfig

    fields = dict(vocab_size=VOCAB, hidden_size=2048, hybrid_override_pattern="MEME*E" * 3,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=128, intermediate_size=4096,
                  mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=8, chunk_size=128,
                  n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=1024,
                  moe_shared_expert_intermediate_size=2048, max_position_embeddings=8192,
                  tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, use_cache=False)
    return NemotronHConfig(**fields | (SMOKE if DEV['smoke'] else {}) | overrides)


def build(dtype: torch.dtype, experts: str = "grouped_mm"):
    from transformers import NemotronHForCausalLM

    torch.manual_seed(0)
    config = hybrid_config()
    config._experts_implementation = experts
    with DEV["device"]:
        model = NemotronHForCausalLM(config).to(dtype)
    return model.train()


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().float(), ref.detach().float()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def flops_per_token(model, seq_len: int) -> tuple[float, int, int]:
    config = model.config
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - routed + routed * config.num_experts_per_tok // config.n_routed_experts
    attn = config.layers_block_type.count("full_attention")
    return 6 * active + 6 * attn * seq_len * config.num_attention_heads * config.head_dim, total, active


def matmul_peak() -> float:
    if DEV["smoke"]:
        return 1e12
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / statistics.median(times)


def check_mixer() -> dict:
    """One bf16 mixer on the Triton path against the fallback on an fp32 copy (same weights, same input)."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    torch.manual_seed(1)
    with DEV["device"]:
        mixer = NemotronHMamba2Mixer(hybrid_config(), layer_idx=0).to(torch.bfloat16).train()
    with torch.no_grad():  # away from the init's all-ones D / dt_bias, so every parameter matters
        for p in (mixer.D, mixer.dt_bias, mixer.norm.weight):
            p.uniform_(0.5, 1.5)
    ref = copy.deepcopy(mixer).float()
    use_kernels(mixer)
    t = 64 if DEV['smoke'] else 4096
    x = torch.randn(2, t, mixer.hidden_size, device=DEV['device'], dtype=torch.bfloat16, requires_grad=True)
    x_ref = x.detach().float().requires_grad_()
    out = mixer(x)
    out_ref = ref(x_ref)
    dy = torch.randn_like(out_ref)
    out.backward(dy.to(out.dtype))
    out_ref.backward(dy)
    errors = {"output": rel(out, out_ref), "d_input": rel(x.grad, x_ref.grad)}
    for (name, p), q in zip(mixer.named_parameters(), ref.parameters(), strict=True):
        errors[f"d_{name}"] = rel(p.grad, q.grad)
    return errors


def loss_and_grads(model, batch, chunk: int = 1024):
    model.zero_grad(set_to_none=True)
    logp, _ = token_logprobs(model, batch.to(DEV['device']), chunk)
    (-logp.sum()).backward()
    return logp.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def random_rows(lengths: list[int], seed: int) -> list[Encoded]:
    rng = random.Random(seed)
    # Token 0 unsupervised (a row's first position is never predicted), the rest supervised.
    return [Encoded([rng.randrange(2, VOCAB) for _ in range(n)], [0] + [1] * (n - 1), False) for n in lengths]


def check_model_fp32() -> dict:
    """Whole model in fp32: Triton path against the fallback, then packed against unpacked rows."""
    fallback = build(torch.float32)
    triton = copy.deepcopy(fallback)
    use_kernels(triton)
    one = pad_batch(random_rows([128 if DEV["smoke"] else 4096], seed=2), pad_id=0)
    logp_f, grads_f = loss_and_grads(fallback, one)
    logp_t, grads_t = loss_and_grads(triton, one)
    grad_err = {n: rel(grads_t[n], g) for n, g in grads_f.items()}
    del fallback, grads_f, grads_t
    rows = random_rows([35, 65, 5, 95] if DEV["smoke"] else [700, 1300, 96, 1900], seed=3)
    alone = [loss_and_grads(triton, pad_batch([r], pad_id=0)) for r in rows]
    logp_alone = torch.cat([a[0] for a in alone])
    grads_alone = {n: sum(a[1][n] for a in alone) for n in alone[0][1]}
    logp_packed, grads_packed = loss_and_grads(triton, pack_batch([rows], pad_id=0, seq_idx=True))
    logp_leaky, _ = loss_and_grads(triton, pack_batch([rows], pad_id=0))
    packed_err = {n: rel(grads_packed[n], g) for n, g in grads_alone.items()}
    return {
        "triton_vs_fallback": {
            "loss_rel": abs(float(logp_t.sum() / logp_f.sum()) - 1),
            "logprob_max_abs": float((logp_t - logp_f).abs().max()),
            "grad_rel_max": max(grad_err.values()), "grad_rel_median": statistics.median(grad_err.values()),
            "grad_rel_worst": max(grad_err, key=grad_err.get)},
        "packed_vs_unpacked": {
            "rows": [len(r.input_ids) for r in rows],
            "logprob_max_abs": float((logp_packed - logp_alone).abs().max()),
            "grad_rel_max": max(packed_err.values()), "grad_rel_worst": max(packed_err, key=packed_err.get),
            "without_seq_idx_logprob_max_abs": float((logp_leaky - logp_alone).abs().max())},
    }


def time_training(model, batches: list, warmup: int, timed: int) -> dict:
    """Median seconds per optimizer step over `timed` steps after `warmup`, cycling through `batches`."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, foreach=True)
    if DEV["device"].type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step in range(warmup + timed):
        batch = batches[step % len(batches)].to(DEV["device"])
        sync()
        start = time.perf_counter()
        logp, _ = token_logprobs(model, batch, 1024)
        loss = -logp.mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if step >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    if not all(map(lambda v: v == v and abs(v) < 1e4, losses)):
        raise SystemExit(f"non-finite training loss: {losses}")
    return {"step_s": statistics.median(times), "step_s_all": times, "losses": losses,
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if DEV["device"].type == "cuda" else 0.0}


def throughput(variant: str, batch: int, seq_len: int, peak: float, steps: tuple[int, int]) -> dict:
    model = build(torch.bfloat16, "eager" if variant == "triton-eager-moe" else "grouped_mm")
    if variant != "fallback":
        use_kernels(model)
    rows = [pad_batch(random_rows([seq_len] * batch, seed=10 + i), pad_id=0) for i in range(2)]
    out = time_training(model, rows, *steps)
    fpt, total, active = flops_per_token(model, seq_len)
    out |= {"tokens_per_s": batch * seq_len / out["step_s"], "params": total, "active_params": active}
    out["mfu"] = fpt * out["tokens_per_s"] / peak
    del model
    if DEV["device"].type == "cuda":
        torch.cuda.empty_cache()
    return out


def packing_gain(seq_len: int, peak: float) -> dict:
    """Real tokens/s on SFT-like rows of 150..2000 tokens: padded micro-batches of 4 rows vs packs."""
    rng = random.Random(5)
    low, high, n = (10, 100, 8) if DEV["smoke"] else (150, 2000, 48)
    rows = random_rows([rng.randrange(low, high) for _ in range(n)], seed=6)
    real = sum(len(r.input_ids) for r in rows)
    padded = [pad_batch(rows[i:i + 4], pad_id=0) for i in range(0, len(rows), 4)]
    packs = pack_rows(rows, seq_len)
    packed = [pack_batch([[rows[j] for j in p] for p in packs[i:i + 2]], pad_id=0, seq_idx=True)
              for i in range(0, len(packs), 2)]
    result = {"rows": len(rows), "real_tokens": real}
    for name, batches in (("padded", padded), ("packed", packed)):
        model = build(torch.bfloat16)
        use_kernels(model)
        # Two warm-up steps (compilation), then every micro-batch once.
        seconds = sum(time_training(model, batches, warmup=2, timed=len(batches))["step_s_all"])
        slots = sum(b.input_ids.numel() for b in batches)
        result[name] = {"micro_batches": len(batches), "token_slots": slots, "seconds": seconds,
                        "real_tokens_per_s": real / seconds, "padding_fraction": 1 - real / slots}
        del model
        if DEV["device"].type == "cuda":
            torch.cuda.empty_cache()
    result["speedup"] = result["packed"]["real_tokens_per_s"] / result["padded"]["real_tokens_per_s"]
    return result


def moe_layer(tokens: int) -> dict:
    """One MoE block of the bench shape, bf16, `tokens` tokens: forward + backward seconds (median of 5 after 2)
    with transformers' grouped expert products and with its loop over experts, and their output's difference."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    torch.manual_seed(4)
    config = hybrid_config()
    with DEV["device"]:
        moe = NemotronHMoE(config, layer_idx=1).to(torch.bfloat16)
        for p in moe.parameters():  # the init leaves the router at zero: random weights route like a trained one
            torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, tokens, config.hidden_size, device=DEV["device"], dtype=torch.bfloat16, requires_grad=True)
    out, outs = {}, {}
    for impl in ("grouped_mm", "eager"):
        config._experts_implementation = impl  # the experts read it at every call
        times = []
        for _ in range(7):
            sync()
            start = time.perf_counter()
            y = moe(x)
            y.float().square().mean().backward()
            sync()
            times.append(time.perf_counter() - start)
        outs[impl] = y.detach()
        out[impl] = {"fwd_bwd_s": statistics.median(times[2:])}
    out["output_rel_diff"] = rel(outs["grouped_mm"], outs["eager"])
    out["speedup"] = out["eager"]["fwd_bwd_s"] / out["grouped_mm"]["fwd_bwd_s"]
    return out


def checks(result: dict) -> None:
    """The correctness checks (module docstring); failures are listed in result['failures']."""
    mixer = result["check_mixer_bf16_vs_fp32_fallback"] = check_mixer()
    print("mixer rel errors: " + ", ".join(f"{k} {v:.1e}" for k, v in mixer.items()), flush=True)
    model_check = result["check_model_fp32"] = check_model_fp32()
    print(json.dumps(model_check, indent=1), flush=True)
    # Bounds: bf16 operands against an fp32 reference land between 1e-3 and 1e-2; fp32 through Triton's tf32
    # dots near 3e-4 per product, more through 18 blocks; unpacked rows must differ from packed ones by far less
    # than rows that leak state do.
    failures = [k for k, v in mixer.items() if not v < 2e-2]
    tv, pv = model_check["triton_vs_fallback"], model_check["packed_vs_unpacked"]
    failures += ["model grads"] * (not tv["grad_rel_max"] < 3e-2) + ["model loss"] * (not tv["loss_rel"] < 1e-3)
    failures += ["packed grads"] * (not pv["grad_rel_max"] < 3e-2)
    failures += ["packed logprobs"] * (not 10 * pv["logprob_max_abs"] < pv["without_seq_idx_logprob_max_abs"])
    # Timed anyway (one call of device time): the JSON and the table say which checks failed.
    result["failures"] = failures
    print(f"checks: {'FAILED ' + str(failures) if failures else 'all passed'}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Result JSON path.")
    parser.add_argument("--batch", type=int, default=2, help="Rows per step in the timed runs.")
    parser.add_argument("--seq-len", type=int, default=4096, help="Tokens per row in the timed runs.")
    parser.add_argument("--parts", nargs="*", default=["checks", "triton", "fallback", "packing", "eager-moe"],
                        help="Parts to run, in this order: checks triton fallback packing eager-moe moe-layer.")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape, reference scan: checks the script.")
    args = parser.parse_args(argv)
    import transformers

    if args.smoke:
        DEV.update(device=torch.device("cpu"), smoke=True)
        args.seq_len = 128
        triton_version = None
    else:
        import triton

        triton_version = triton.__version__

    result = {"command": " ".join(["python3", *sys.argv]), "date": datetime.now(UTC).isoformat(),
              "gpu": torch.cuda.get_device_name() if not args.smoke else "cpu (smoke)", "host": platform.node(),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "triton": triton_version, "cuda": torch.version.cuda}}
    peak = result["matmul_peak_flops"] = matmul_peak()
    print(f"bf16 matmul peak {peak / 1e12:.0f} TFLOP/s", flush=True)
    if "checks" in args.parts:
        checks(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs = result["train"] = {}
    if "moe-layer" in args.parts:
        moe = result["moe_layer"] = moe_layer(args.batch * args.seq_len)
        print(f"moe layer fwd+bwd: grouped_mm {moe['grouped_mm']['fwd_bwd_s'] * 1e3:.1f} ms, eager loop "
              f"{moe['eager']['fwd_bwd_s'] * 1e3:.1f} ms ({moe['speedup']:.2f}x), outputs differ by "
              f"{moe['output_rel_diff']:.1e}", flush=True)
        args.out.write_text(json.dumps(result, indent=1))
    # Most wanted first (a call can run out of time): the project's path, the fallback, packing, the expert loop.
    for part, steps in (("triton", (3, 5)), ("fallback", (1, 2)), ("packing", None), ("eager-moe", (1, 3))):
        if part not in args.parts:
            continue
        if part == "packing":
            pk = result["packing"] = packing_gain(args.seq_len, peak)
            print(f"packing: {pk['padded']['real_tokens_per_s']:.0f} -> {pk['packed']['real_tokens_per_s']:.0f} "
                  f"real tok/s ({pk['speedup']:.2f}x; padding {pk['padded']['padding_fraction']:.0%} -> "
                  f"{pk['packed']['padding_fraction']:.0%})", flush=True)
        else:
            variant = "triton-eager-moe" if part == "eager-moe" else part
            r = runs[variant] = throughput(variant, args.batch, args.seq_len, peak, steps)
            print(f"{variant:18s} {r['tokens_per_s']:9.0f} tok/s  MFU {r['mfu']:.1%}  peak {r['peak_gb']:.1f} GB",
                  flush=True)
        args.out.write_text(json.dumps(result, indent=1))
    if "triton" in runs and "fallback" in runs:
        result["speedup_vs_fallback"] = runs["triton"]["tokens_per_s"] / runs["fallback"]["tokens_per_s"]
    if "triton" in runs and "triton-eager-moe" in runs:
        result["speedup_grouped_vs_eager_moe"] = (runs["triton"]["tokens_per_s"]
                                                  / runs["triton-eager-moe"]["tokens_per_s"])
    args.out.write_text(json.dumps(result, indent=1))
    print("\n| path | tokens/s | MFU | peak GB |\n| --- | --- | --- | --- |")
    for variant, r in runs.items():
        print(f"| {variant} | {r['tokens_per_s']:.0f} | {r['mfu']:.1%} | {r['peak_gb']:.1f} |")
    for key in ("speedup_vs_fallback", "speedup_grouped_vs_eager_moe"):
        if key in result:
            print(f"{key}: {result[key]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
