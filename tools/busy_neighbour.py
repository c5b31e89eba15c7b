"""The default model's greedy tok/s on a quiet machine and beside one busy neighbour (a
single-threaded `while True: pass` for the run's length), with the thread count following the
free cores (the default) and fixed (CONSTRAINED_SPEC_FOLLOW_CORES=0): each run a fresh process,
4 extraction prompts x 3, warm model.

    python tools/busy_neighbour.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

RUN = """
import time, torch
from constrained_spec import Generator
gen = Generator.from_pretrained()
docs = ["Alice is 30 years old and her email is alice@example.com.",
        "Bob, 41, can be reached at bob.smith@mail.org.",
        "Carol (age 27) writes from carol@uni.edu about the budget.",
        "Dan is 55; contact dan@work.net."]
ask = lambda d: [{"role": "user", "content": "Extract the person: " + d}]
gen.generate(ask(docs[0]), schema="examples/person.json", max_new_tokens=64)  # warm
n, start = 0, time.perf_counter()
for _ in range(3):
    for d in docs:
        n += len(gen.generate(ask(d), schema="examples/person.json", max_new_tokens=128).token_ids)
print(n / (time.perf_counter() - start))
"""


def tok_s(follow: bool) -> float:
    env = os.environ | {"CONSTRAINED_SPEC_FOLLOW_CORES": "1" if follow else "0"}
    done = subprocess.run(
        [sys.executable, "-c", RUN], env=env, capture_output=True, text=True, check=True
    )
    return float(done.stdout.split()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    for busy in (False, True):
        neighbour = None
        if busy:
            neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(1)
        try:
            for follow in (True, False):
                runs = [tok_s(follow) for _ in range(args.repeats)]
                name = f"{'busy' if busy else 'quiet'}, threads {'follow' if follow else 'fixed'}"
                print(f"{name:28s} " + " ".join(f"{r:.1f}" for r in runs) + " tok/s")
        finally:
            if neighbour is not None:
                neighbour.kill()


if __name__ == "__main__":
    main()
