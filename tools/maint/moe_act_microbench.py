"""Per-step cost of the MoE experts' fused SwiGLU alone, as SequentialMLP calls it (issue 38).

    PYTHONPATH=TREE python3 tools/maint/moe_act_microbench.py [--eager] [--tokens N ...]

One "step" calls ``weighted_bias_swiglu_impl`` forward and backward once per local expert and
layer (8 experts x 8 layers), each on that expert's share of ``tokens`` routed tokens (ffn 4096,
bf16 activations, fp32 routing probs split per expert as SequentialMLP splits them), with counts
drawn anew every step (seeded; 0 and 1 included now and then). Prints, per token total, the
median wall time of steps 21-60 (synchronized at the step's end), the first step's, and the
dynamo graphs held at the end. ``--eager`` runs under ``torch.compiler.set_stance('force_eager')``.
"""

import argparse
import os
import statistics
import time

import torch

from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

EXPERTS, LAYERS = 8, 8
FFN = int(os.environ.get("MOE_BENCH_FFN", 4096))


def _counts(gen, tokens):
    probs = torch.rand(EXPERTS, generator=gen) ** 3
    counts = torch.multinomial(probs / probs.sum(), tokens, replacement=True, generator=gen)
    counts = torch.bincount(counts, minlength=EXPERTS)
    if torch.rand(1, generator=gen).item() < 0.2:  # now and then an expert with 1 or 0 tokens
        e = int(torch.randint(EXPERTS, (1,), generator=gen))
        spare = int(counts[e]) - int(torch.randint(2, (1,), generator=gen))
        counts[e] -= spare
        counts[(e + 1) % EXPERTS] += spare
    return counts.tolist()


def _step(y, probs, counts):
    outs = []
    for _ in range(LAYERS):
        for tokens, weights in zip(torch.split(y, counts), torch.split(probs, counts)):
            outs.append(weighted_bias_swiglu_impl(tokens, None, weights.unsqueeze(-1)))
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


def _sync(device):
    if device != 'cpu':
        torch.cuda.synchronize()


def main():
    """Parse the arguments, run the steps per token total, print a line each."""
    parser = argparse.ArgumentParser()
    parser.add_argument('--eager', action='store_true')
    parser.add_argument('--tokens', type=int, nargs='+', default=[4096, 32768])
    parser.add_argument('--steps', type=int, default=60)
    parser.add_argument('--device', default='cuda')
    args = parser.parse_args()
    if args.eager:
        torch.compiler.set_stance('force_eager')
    from torch._dynamo.utils import counters

    for tokens in args.tokens:
        gen = torch.Generator().manual_seed(38)
        y = torch.randn(
            tokens, 2 * FFN, device=args.device, dtype=torch.bfloat16, requires_grad=True
        )
        probs = torch.rand(tokens, device=args.device, requires_grad=True)
        times = []
        for _ in range(args.steps):
            counts = _counts(gen, tokens)
            _sync(args.device)
            start = time.perf_counter()
            _step(y, probs, counts)
            _sync(args.device)
            times.append(time.perf_counter() - start)
        print(
            f'tokens {tokens}: steady {statistics.median(times[20:]) * 1e3:.2f} ms/step, '
            f'first {times[0] * 1e3:.1f} ms, graphs held {counters["stats"]["unique_graphs"]}',
            flush=True,
        )


if __name__ == '__main__':
    main()
