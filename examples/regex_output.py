"""Regex-constrained output: a date, a phone number, and a ready-made grammar (shipped with
the package, from the grammars/ folder).

    python examples/regex_output.py
"""

from constrained_spec import Generator
from constrained_spec.constraints import load_grammar

gen = Generator.from_pretrained()  # the default model, draft="auto"

ASKS = [
    (
        "When did the Berlin Wall fall? Answer with the date only.",
        r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    ),  # a date
    (
        "Write the phone number +1 415 555 2671 in international format without spaces.",
        r"\+[1-9][0-9]{6,14}",
    ),  # E.164
    ("Is Paris the capital of France? Answer yes or no.", r"(yes|no)"),  # a choice
    (
        "Who should I write to? The notice says: contact bob.smith@example.org for details.",
        load_grammar("email")["regex"],
    ),  # a shipped grammar
]

for question, regex in ASKS:
    messages = [{"role": "user", "content": question}]
    result = gen.generate(messages, regex=regex, max_new_tokens=24)
    # "length": cut at max_new_tokens, so the text is a prefix, not a match of the regex
    answer = repr(result.text) if result.finish_reason == "stop" else "no answer within 24 tokens"
    print(
        f"{question}\n  -> {answer}  ({result.stats.target_calls} target calls for "
        f"{len(result.token_ids)} tokens)"
    )
    if result.finish_reason == "length":
        print(f"     (incomplete, cut at max_new_tokens: {result.text!r})")
