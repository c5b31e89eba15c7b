"""Structured extraction with a Pydantic model as the schema.

    python examples/extract_pydantic.py ["Some text about a person"]

The output is guaranteed to parse and validate: the model can only emit tokens that keep the text
inside the schema's language, and speculation does not change which text it emits (greedy here).
"""

import sys

from pydantic import BaseModel, Field

from constrained_spec import Generator


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=150)
    city: str = Field(max_length=40)


TEXTS = sys.argv[1:] or [
    "Alice is 30 and lives in Paris.",
    "Our new colleague, Bob Smith (42), just moved here from Toronto.",
]

gen = Generator.from_pretrained()  # the default model and its draft head, fetched once, then cached
for text in TEXTS:
    messages = [{"role": "user", "content": f"Extract the person's name, age and city: {text}"}]
    result = gen.generate(messages, schema=Person, max_new_tokens=64)
    person = Person.model_validate_json(result.text)  # always valid when finish_reason == "stop"
    s = result.stats
    print(
        f"{text!r}\n  -> {person!r}\n  ({len(result.token_ids)} tokens in {s.target_calls} "
        f"target calls, {s.total_s:.2f} s, finish: {result.finish_reason})"
    )
