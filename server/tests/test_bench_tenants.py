"""`cadence bench --tenants`: the file's tenants with their keys, lengths and traffic, and
errors that name the entry and the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from cadence_bench.tenants import read_tenants

DEFAULT_IN, DEFAULT_OUT = (320, 320), (32, 256)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    return path


def test_tenants_take_their_own_settings_and_the_flags_lengths_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCH_KEY", "sk-batch")
    path = write(
        tmp_path,
        """
- name: batch
  api_key_env: BATCH_KEY
  num_prompts: 48
  max_concurrency: 48
  output_len: "200:256"
- name: chat
  api_key: sk-chat
  num_prompts: 10
  request_rate: 1.5
  input_len: 64
""",
    )
    batch, chat = read_tenants(path, DEFAULT_IN, DEFAULT_OUT)
    assert (batch.name, batch.api_key, batch.num_prompts) == ("batch", "sk-batch", 48)
    assert (batch.max_concurrency, batch.request_rate) == (48, float("inf"))
    assert (batch.input_len, batch.output_len) == (DEFAULT_IN, (200, 256))
    assert (chat.api_key, chat.request_rate, chat.max_concurrency) == ("sk-chat", 1.5, None)
    assert (chat.input_len, chat.output_len) == ((64, 64), DEFAULT_OUT)


def test_json_is_read_too(tmp_path: Path) -> None:
    path = write(tmp_path, '[{"name": "a", "num_prompts": 2}]')
    (a,) = read_tenants(path, DEFAULT_IN, DEFAULT_OUT)
    assert (a.name, a.api_key, a.num_prompts) == ("a", None, 2)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{}", "non-empty list"),
        ("- {num_prompts: 1}}", "not YAML or JSON"),
        ("- num_prompts: 0", "tenant 0.num_prompts"),
        ("- {num_prompts: 1, colour: red}", "unknown field(s) colour"),
        ("- {name: a, num_prompts: 1}\n- {name: a, num_prompts: 1}", "tenant 1.name"),
        ("- {num_prompts: 1, input_len: '9:3'}", "tenant 0.input_len"),
        ("- {num_prompts: 1, api_key_env: CADENCE_NO_SUCH_VARIABLE}", "is not set"),
    ],
)
def test_a_bad_file_names_the_entry_and_field(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(ValueError, match=None) as err:
        read_tenants(write(tmp_path, text), DEFAULT_IN, DEFAULT_OUT)
    assert says in str(err.value)
