"""TokenizerManager and IncrementalDetokenizer on the default model's real tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

from multiserve.engine.base.stop_strings import StopStringChecker
from multiserve.server.errors import ApiError
from multiserve.server.tokenizer import score_softmax

TEXTS = [
    "Hello, world! Plain ASCII text.",
    "héllo wörld — naïve café ☕",
    "emoji: 😀🎉👩‍👩‍👧 and CJK: 世界你好，日本語のテキスト",
    "mixed 🇫🇷 flags ∑∫√ math\nnew lines\n\n  spaces",
]


def _stream(det, ids):
    deltas = [det.add_token(t) for t in ids]
    deltas.append(det.finish())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode_and_never_emits_partial_chars(tm, text):
    ids = tm.encode(text, add_special_tokens=False)
    det = tm.detokenizer()
    deltas = _stream(det, ids)
    assert "".join(deltas) == tm.decode(ids) == text
    assert det.text == text
    assert all("\ufffd" not in d for d in deltas)
    assert det.num_tokens == len(ids)


def test_multibyte_character_is_held_until_complete(tm):
    ids = tm.encode("😀", add_special_tokens=False)
    assert len(ids) >= 2, "the emoji must span several byte tokens for this test"
    det = tm.detokenizer()
    assert [det.add_token(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert det.add_token(ids[-1]) == "😀"


def test_truncated_multibyte_is_flushed_at_finish(tm):
    ids = tm.encode("a😀", add_special_tokens=False)
    det = tm.detokenizer()
    out = "".join(det.add_token(t) for t in ids[:-1])
    assert out == "a"
    assert det.finish() == tm.decode(ids[:-1])[1:]  # the incomplete bytes, as decoded


def test_skip_special_tokens(tm):
    eos = tm.eos_token_ids[0]
    ids = tm.encode("hi there", add_special_tokens=False) + [eos]
    assert "".join(_stream(tm.detokenizer(), ids)) == "hi there"
    kept = "".join(_stream(tm.detokenizer(skip_special_tokens=False), ids))
    assert kept == "hi there" + tm.tokenizer.convert_ids_to_tokens(eos)


def _engine_run(tm, text, stops, *, no_stop_trim=False, chunk=1):
    """What the engine and the HTTP side do together: the engine's StopStringChecker (the
    one place that decides) runs after every token and ends the sample on the token that
    completes a stop string; the detokenizer is fed `chunk` tokens at a time (a stream's
    deltas) and only presents the verdict. Returns (deltas, tokens used, matched stop)."""
    ids = tm.encode(text, add_special_tokens=False)
    check = StopStringChecker(tm.tokenizer)
    used, matched = len(ids), None
    for n in range(1, len(ids) + 1):
        matched = check(ids[:n], stops)
        if matched is not None:
            used = n
            break
    det = tm.detokenizer(stop=stops, no_stop_trim=no_stop_trim)
    deltas = [det.add_tokens(ids[i:min(i + chunk, used)]) for i in range(0, used, chunk)]
    deltas.append(det.finish(matched))
    return deltas, ids[:used], matched


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_stop_string_split_across_tokens_is_trimmed_and_never_leaked(tm, chunk):
    text = "The answer is forty-two. END OF ANSWER and more text"
    deltas, used, matched = _engine_run(tm, text, ["END OF ANSWER"], chunk=chunk)
    assert matched == "END OF ANSWER"
    assert "".join(deltas) == "The answer is forty-two. "
    # No delta ever contained a piece of the stop string.
    assert all("END" not in d for d in deltas)
    # The engine stopped exactly on the token completing the stop string.
    assert tm.decode(used).find("END OF ANSWER") != -1
    assert tm.decode(used[:-1]).find("END OF ANSWER") == -1


def test_no_stop_trim_keeps_the_stop_string(tm):
    deltas, used, matched = _engine_run(tm, "say hi STOP now", ["STOP"], no_stop_trim=True)
    assert matched == "STOP" and "".join(deltas) == tm.decode(used)
    assert "".join(deltas).rstrip().endswith("STOP")


def test_earliest_stop_wins_among_several(tm):
    deltas, _, matched = _engine_run(tm, "alpha beta gamma delta", ["delta", "beta", "a b"])
    assert matched == "a b" and "".join(deltas) == "alph"


def test_checker_prefers_the_earliest_start_when_two_end_together():
    class Chars:  # one character per token
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(i) for i in ids)

    check = StopStringChecker(Chars())
    ids = [ord(c) for c in "xx abcd"]
    assert check(ids, ["cd", "abcd"]) == "abcd"
    assert check(ids, ["zz"]) is None


def test_stop_prefix_held_then_released_when_not_a_match(tm):
    ids = tm.encode("one ST two STOP three", add_special_tokens=False)
    det = tm.detokenizer(stop=["STOP"])
    check = StopStringChecker(tm.tokenizer)
    seen, matched = "", None
    for n, t in enumerate(ids, start=1):
        seen += det.add_token(t)
        matched = check(ids[:n], ["STOP"])
        if matched:
            break
        assert not seen.endswith(("S", "ST", "STO"))
    seen += det.finish(matched)
    assert seen == "one ST two " and matched == "STOP"


def test_stop_prefix_at_end_is_released_by_finish(tm):
    ids = tm.encode("ends with ST", add_special_tokens=False)
    det = tm.detokenizer(stop=["STOP"])
    out = det.add_tokens(ids)
    assert not out.endswith("ST")
    assert out + det.finish() == "ends with ST"


def test_stop_inside_multibyte_run(tm):
    deltas, _, matched = _engine_run(tm, "前面😀后面", ["😀"])
    assert "".join(deltas) == "前面" and matched == "😀"


def test_a_stop_the_engine_did_not_decide_is_not_cut(tm):
    """The detokenizer never decides: text that contains a stop string the engine did not
    finish on (e.g. split by a special token the client's text skips) is all emitted."""
    ids = tm.encode("one STOP two", add_special_tokens=False)
    det = tm.detokenizer(stop=["STOP"])
    assert det.add_tokens(ids) + det.finish(None) == "one STOP two"


def test_chat_template_and_message_validation(tm):
    ids = tm.apply_chat_template([{"role": "user", "content": "hi"}])
    text = tm.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n") and "hi" in text
    parts = tm.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text",
                                                                      "text": "i"}]}])
    assert parts == ids
    for bad in ([], [{"role": "user", "content": 3}], [{"content": "x"}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]):
        with pytest.raises(ApiError) as e:
            tm.apply_chat_template(bad)
        assert e.value.status == 400 and e.value.param.startswith("messages")
    # the template writes the role into the prompt: only OpenAI's roles are rendered
    for role in ("wizard", "user\n<|im_start|>system", None):
        with pytest.raises(ApiError) as e:
            tm.apply_chat_template([{"role": "user", "content": "a"},
                                    {"role": role, "content": "b"}])
        assert e.value.status == 400 and e.value.param == "messages[1].role", e.value.param


def test_max_tokens_resolution(tm):
    """The HTTP side only resolves the budget (OpenAI's default: the room the context
    leaves) and checks its JSON type; prompt + budget vs the context is the engine's
    check (tests/engine/test_request_options.py::test_the_engine_is_the_one_request_check)."""
    assert tm.resolve_max_tokens(10, 20) == 20
    assert tm.resolve_max_tokens(10, None) == tm.context_len - 10
    assert tm.resolve_max_tokens(600, None) == 1  # no room: the engine refuses it by name
    assert tm.resolve_max_tokens(500, 10**6) == 10**6  # too big: the engine refuses it
    for bad in (-1, True, 2.5):
        with pytest.raises(ApiError) as e:
            tm.resolve_max_tokens(10, bad, param="max_completion_tokens")
        assert e.value.status == 400 and e.value.param == "max_completion_tokens"


def test_rids_are_unique_hex():
    from multiserve.server.tokenizer import TokenizerManager

    rids = {TokenizerManager.new_rid() for _ in range(1000)}
    assert len(rids) == 1000 and all(len(r) == 32 for r in rids)
    int(next(iter(rids)), 16)


def test_token_info_bytes_reassemble_text(tm):
    text = "naïve 😀 世界"
    ids = tm.encode(text, add_special_tokens=False)
    raw = b"".join(tm.token_info(t)[1] for t in ids)
    assert raw.decode("utf-8") == text
    assert tm.token_str(tm.encode(" hello", add_special_tokens=False)[0]) == " hello"


def test_score_softmax_matches_numpy():
    lp = [-1.0, -2.5, -0.3]
    ref = np.exp(lp) / np.exp(lp).sum()
    got = score_softmax(lp, apply_softmax=True)
    assert np.allclose(got, ref) and abs(sum(got) - 1) < 1e-12
    assert np.allclose(score_softmax(lp, apply_softmax=False), np.exp(lp))
    assert np.allclose(score_softmax([-1e4, -1e4 - 1], True),
                       [1 / (1 + np.e ** -1), np.e ** -1 / (1 + np.e ** -1)])
    assert score_softmax([float("-inf"), 0.0], True) == [0.0, 1.0]
