"""How long quantized builds keep a reference build's greedy chat answers, over many short questions.

    .venv/bin/python -m bench.bench_greedy_fidelity REF ART [ART ...] [--tokens 48]

Each artifact answers every question in bench/fidelity_questions.txt (chat template, greedy, --tokens
new tokens, one batch); for each candidate the script prints how many tokens of each answer match
REF's (usually the fp32 build) before the first difference (mean, median, answers kept whole), how
often each pair of candidates keeps it longer, and every build's answer to the first question. One
question's answer is a lottery on a small int8 model (its greedy path forks wherever the top two
tokens nearly tie); the mean over many is what separates a change that loses fidelity from one that
does not. The build's own check (teacher-forced top-1 and perplexity) does not see this.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path

QUESTIONS = Path(__file__).with_name("fidelity_questions.txt")


def answers(artifact: str, questions: list[str], tokens: int) -> list[list[int]]:
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    llm = LLM(artifact)
    try:
        outs = llm.chat([[{"role": "user", "content": q}] for q in questions],
                        SamplingParams(max_tokens=tokens, temperature=0))
        first = outs[0].text.strip().replace("\n", " ")
        print(f"{artifact}: {first[:120]!r}", flush=True)
        return [list(o.token_ids) for o in outs]
    finally:
        llm.shutdown()


def kept(reference: list[int], answer: list[int]) -> int:
    """Tokens of answer equal to reference's before the first difference."""
    return next((i for i, (a, b) in enumerate(zip(reference, answer)) if a != b), min(len(reference), len(answer)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reference")
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    questions = [q for q in QUESTIONS.read_text().splitlines() if q.strip()]
    ref = answers(args.reference, questions, args.tokens)
    runs = {art: [kept(r, a) for r, a in zip(ref, answers(art, questions, args.tokens))] for art in args.artifacts}
    print(f"\n{len(questions)} questions, {args.tokens} greedy tokens; tokens kept from {args.reference}'s answers:")
    for art, counts in runs.items():
        whole = sum(c == len(r) for c, r in zip(counts, ref))
        print(f"  {art}: mean {statistics.mean(counts):.1f}, median {statistics.median(counts):g}, "
              f"whole {whole}/{len(questions)}")
    for (a, ca), (b, cb) in itertools.combinations(runs.items(), 2):
        longer = sum(x > y for x, y in zip(ca, cb))
        shorter = sum(x < y for x, y in zip(ca, cb))
        print(f"  {a} kept longer than {b} on {longer}, shorter on {shorter}, as long on {len(ca) - longer - shorter}")


if __name__ == "__main__":
    main()
