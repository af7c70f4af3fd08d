"""TokenizerManager and IncrementalDetokenizer on the default model's real tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

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


def test_stop_string_split_across_tokens_is_trimmed_and_never_leaked(tm):
    text = "The answer is forty-two. END OF ANSWER and more text"
    ids = tm.encode(text, add_special_tokens=False)
    det = tm.detokenizer(stop=["END OF ANSWER"])
    deltas = []
    for t in ids:
        deltas.append(det.add_token(t))
        if det.stopped:
            break
    out = "".join(deltas)
    assert out == "The answer is forty-two. "
    assert det.stopped and det.matched_stop == "END OF ANSWER"
    # No delta ever contained a piece of the stop string.
    assert all("END" not in d for d in deltas)
    # Tokens consumed: exactly up to the token completing the stop string.
    assert tm.decode(ids[:det.num_tokens]).find("END OF ANSWER") != -1
    assert tm.decode(ids[:det.num_tokens - 1]).find("END OF ANSWER") == -1
    assert det.finish() == ""


def test_earliest_stop_wins_among_several(tm):
    text = "alpha beta gamma delta"
    ids = tm.encode(text, add_special_tokens=False)
    det = tm.detokenizer(stop=["delta", "beta", "a b"])
    out = det.add_tokens(ids)
    assert det.stopped
    assert out == "alph" and det.matched_stop == "a b"


def test_stop_prefix_held_then_released_when_not_a_match(tm):
    ids = tm.encode("one ST two STOP three", add_special_tokens=False)
    det = tm.detokenizer(stop=["STOP"])
    seen = ""
    for t in ids:
        seen += det.add_token(t)
        assert not seen.endswith(("S", "ST", "STO")) or det.stopped
        if det.stopped:
            break
    assert seen == "one ST two "
    assert det.matched_stop == "STOP"


def test_stop_prefix_at_end_is_released_by_finish(tm):
    ids = tm.encode("ends with ST", add_special_tokens=False)
    det = tm.detokenizer(stop=["STOP"])
    out = det.add_tokens(ids)
    assert not out.endswith("ST")
    assert out + det.finish() == "ends with ST"
    assert not det.stopped


def test_stop_inside_multibyte_run(tm):
    ids = tm.encode("前面😀后面", add_special_tokens=False)
    det = tm.detokenizer(stop=["😀"])
    out = det.add_tokens(ids)
    assert out == "前面" and det.matched_stop == "😀"


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


def test_length_validation(tm):
    assert tm.check_length(10, 20) == 20
    assert tm.check_length(10, None) == tm.context_len - 10
    for prompt_len, max_new in ((600, 1), (512, 1), (500, 13), (10, -1), (0, 5)):
        with pytest.raises(ApiError) as e:
            tm.check_length(prompt_len, max_new)
        assert e.value.status == 400
    with pytest.raises(ApiError) as e:
        tm.check_length(500, 100, param="max_completion_tokens")
    assert e.value.param == "max_completion_tokens" and "512" in e.value.message


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
