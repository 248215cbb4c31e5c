"""labkit.widgets.tokenizer: the BPE explorer's prefix vocabularies, numbers, coloured sample, plot, callback and widget
(matplotlib's Agg backend)."""
import labkit  # noqa: F401

import matplotlib

matplotlib.use("Agg")

import re  # noqa: E402
from html.parser import HTMLParser  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from labkit.datapipe import EOT  # noqa: E402
from labkit.tokenizer import Tokenizer, train_bpe  # noqa: E402
from labkit.widgets import tokenizer as W  # noqa: E402

SMALL_TEXT = ("the cat sat on the mat. the dog sat on the log. " * 30 + "naïve café, façade & <b>bold</b> \"quoted\" 'single'\n") * 3
SMALL_HELDOUT = "the cat and the dog sat; a naïve log. 12 < 13 & 'x' > \"y\"\n"


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def explorer():
    """The chapter's explorer: the cleaned, deduplicated datapipe corpus, trained once to 4096 tokens."""
    return W.default_explorer()


@pytest.fixture(scope="module")
def small():
    return W.BPEExplorer(SMALL_TEXT, SMALL_HELDOUT, max_vocab_size=300, special_tokens=[EOT])


@pytest.fixture(scope="module")
def trained_smaller(explorer, tmp_path_factory):
    """train_bpe run independently at smaller sizes on the explorer's training text: {size: (vocab, merges)}."""
    path = tmp_path_factory.mktemp("bpe") / "train.txt"
    path.write_text(explorer.train_text, encoding="utf-8")
    return {size: train_bpe(path, size, [EOT]) for size in (300, 700)}


class Spans(HTMLParser):
    """The token spans of tokens_html: (text, title, data-ids) each, text unescaped."""

    def __init__(self, markup: str):
        super().__init__(convert_charrefs=True)
        self.spans, self.current = [], None
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "span" and attrs.get("class") == "bpe-token":
            self.current = ["", attrs["title"], [int(i) for i in attrs["data-ids"].split()]]

    def handle_data(self, data):
        if self.current is not None:
            self.current[0] += data

    def handle_endtag(self, tag):
        if tag == "span" and self.current is not None:
            self.spans.append(tuple(self.current))
            self.current = None


def test_readable_shows_printable_utf8_and_escapes_the_rest():
    assert W.readable(b" the") == " the"
    assert W.readable("é".encode()) == "é"
    assert W.readable("é".encode()[:1]) == "\\xc3"  # half a character: not UTF-8 on its own
    assert W.readable(b"a\nb\t") == "a\\nb\\t"
    assert W.readable(b"\\x") == "\\\\x"  # a real backslash is not mistaken for an escape
    assert W.readable(b"\xff\x00") == "\\xff\\x00"
    with pytest.raises(TypeError, match="token="):
        W.readable("text")


@pytest.mark.parametrize("size", [300, 700])
def test_a_smaller_vocabulary_is_a_prefix_of_the_merges(explorer, trained_smaller, size):
    vocab, merges = trained_smaller[size]
    assert explorer.merges_for(size) == merges
    assert explorer.merges[: len(merges)] == merges
    assert explorer.vocab_for(size) == vocab
    assert explorer.merge_count(size) == len(merges) == size - 257  # no merge here repeats a token


@pytest.mark.parametrize("size", [300, 700])
def test_bytes_per_token_match_a_tokenizer_trained_at_that_size(explorer, trained_smaller, size):
    tokenizer = Tokenizer(*trained_smaller[size], [EOT])
    train_ids, heldout_ids = tokenizer.encode(explorer.train_text), tokenizer.encode(explorer.heldout_text)
    data = W.bpe_explorer_view(explorer, size)
    assert data["train_tokens"] == len(train_ids) and data["heldout_tokens"] == len(heldout_ids)
    assert data["train_bytes_per_token"] == len(explorer.train_text.encode()) / len(train_ids)
    assert data["heldout_bytes_per_token"] == len(explorer.heldout_text.encode()) / len(heldout_ids)
    assert data["ids"] == tokenizer.encode(W.DEFAULT_SAMPLE)
    assert data["sample_bytes_per_token"] == len(W.DEFAULT_SAMPLE.encode()) / len(data["ids"])


@pytest.mark.parametrize("size", [257, 1024, 4096])
def test_replayed_counts_match_encoding_at_other_sizes(explorer, size):
    tokenizer = explorer.tokenizer(size)
    assert explorer.token_counts(size) == (len(tokenizer.encode(explorer.train_text)), len(tokenizer.encode(explorer.heldout_text)))
    if size == 257:
        assert explorer.token_counts(size)[0] == len(explorer.train_text.encode()) - explorer.train_text.count(EOT) * (len(EOT) - 1)


def test_the_chapter_corpus_holds_out_every_tenth_document(explorer):
    assert explorer.max_vocab_size == 4096 and explorer.min_vocab_size == 257
    assert explorer.heldout_text and explorer.heldout_text not in explorer.train_text
    assert set(explorer.seconds) == {"corpus", "train", "replay"}
    curve = explorer.curve()
    assert curve["vocab_size"][0] == 257 and curve["vocab_size"][-1] == 4096 and len(curve["train"]) == 4096 - 256
    assert all(a <= b for a, b in zip(curve["train"], curve["train"][1:]))  # a merge never adds a training token
    assert curve["train"][-1] > curve["heldout"][-1] > 3.0  # the vocabulary fits its own text best


def test_replay_follows_the_encoder_when_a_merge_remakes_an_earlier_merges_half():
    # merge 0 joins "ab" (which only merge 1 makes) with "c": the encoder, having made "ab", goes on to "abc"
    vocab = {i: bytes([i]) for i in range(256)} | {256: b"ab", 257: b"abc", 258: b"bc"}
    merges = [(b"ab", b"c"), (b"a", b"b"), (b"b", b"c")]
    texts = ["abc abcab bcb", "ab c"]
    counts = W.replay_token_counts(vocab, merges, texts)
    for k in range(len(merges) + 1):
        tokenizer = Tokenizer(vocab, merges[:k])
        assert [c[k] for c in counts] == [len(tokenizer.encode(t)) for t in texts], k


def test_view_lists_the_first_and_last_merges_readably(explorer):
    data = W.bpe_explorer_view(explorer, 1024, merges_shown=5)
    merges = explorer.merges_for(1024)
    assert data["num_merges"] == 767 and data["vocab_size"] == 1024
    assert data["first_merges"] == [(r + 1, W.readable(a), W.readable(b), W.readable(a + b)) for r, (a, b) in enumerate(merges[:5])]
    assert [row[0] for row in data["last_merges"]] == [763, 764, 765, 766, 767]
    assert data["last_merges"][-1][3] == W.readable(b"".join(merges[-1]))
    assert "first 5 merges" in data["html"] and "of 767" in data["html"]
    assert "1,024 tokens = 256 bytes + 1 special + 767 from 767 merges" in W.explorer_summary(data)
    empty = W.bpe_explorer_view(explorer, 257)
    assert empty["num_merges"] == 0 and empty["first_merges"] == empty["last_merges"] == []
    assert "no merges yet" in empty["html"]
    (left, right), = explorer.merges_for(258)
    one = W.bpe_explorer_view(explorer, 258, merges_shown=8)
    assert one["first_merges"] == one["last_merges"] == [(1, W.readable(left), W.readable(right), W.readable(left + right))]


@pytest.mark.parametrize("size", [257, 1024, 4096])
def test_coloured_sample_concatenates_to_the_sample_and_escapes_html(explorer, size):
    sample = 'a <b>bold</b> & "quoted" \'single\' naïve café 😀\n\tx  y' + EOT + "end"
    data = W.bpe_explorer_view(explorer, size, sample)
    spans = Spans(data["tokens_html"]).spans
    assert "".join(text for text, _, _ in spans) == sample
    assert [i for _, _, ids in spans for i in ids] == data["ids"] == explorer.tokenizer(size).encode(sample)
    for text, title, ids in spans:
        assert title.startswith(f"id {ids[0]}:" if len(ids) == 1 else f"ids {' '.join(map(str, ids))}:")
    markup = data["tokens_html"]
    for inner in re.findall(r'<span class="bpe-token"[^>]*>(.*?)</span>', markup, re.DOTALL):
        assert not set(inner) & set("<>\"'") and re.fullmatch(r"([^&]|&(lt|gt|amp|quot|#x27);)*", inner, re.DOTALL)
    assert all(entity in markup for entity in ("&lt;", "&gt;", "&amp;", "&quot;", "&#x27;"))
    assert "<b>" not in markup and len(re.findall("<span", markup)) == len(spans)
    quote = next(title for text, title, _ in spans if '"' in text)
    assert '"' in quote  # the title attribute holds the quote, escaped in the markup
    assert data["tokens_html"] in data["html"]
    if size == 257:  # single bytes: every non-ASCII character is split over its bytes, shown as one piece
        split = [(text, ids) for text, _, ids in spans if len(ids) > 1]
        assert ("ï", [0xC3, 0xAF]) in split and ("😀", list("😀".encode())) in split
        assert any(text == EOT and ids == [256] for text, _, ids in spans)


def test_neighbouring_tokens_get_different_colours(explorer):
    data = W.bpe_explorer_view(explorer, 512, "one two three four five six seven eight")
    colours = [part.split(";")[0] for part in data["tokens_html"].split("background:")[1:]]
    assert len(colours) == len(data["ids"]) > len(W.TOKEN_COLORS) and all(a != b for a, b in zip(colours, colours[1:]))


def test_bad_arguments_name_the_argument_and_the_range(explorer, small):
    with pytest.raises(ValueError, match=r"vocab_size=256: expected an int in \[257, 4096\]"):
        W.bpe_explorer_view(explorer, 256)
    with pytest.raises(ValueError, match=r"vocab_size=4097: expected an int in \[257, 4096\]"):
        W.bpe_explorer_view(explorer, 4097)
    with pytest.raises(ValueError, match=r"vocab_size=301: expected an int in \[257, 300\] \(256 bytes \+ 1 special token, up"):
        small.merges_for(301)
    for bad in (1024.0, True, "1024"):
        with pytest.raises(TypeError, match="vocab_size="):
            W.bpe_explorer_view(explorer, bad)
    with pytest.raises(ValueError, match="merges_shown=0"):
        W.bpe_explorer_view(explorer, 1024, merges_shown=0)
    with pytest.raises(ValueError, match="sample: 10,001 characters"):
        W.bpe_explorer_view(explorer, 1024, "x" * 10_001)
    with pytest.raises(TypeError, match="sample"):
        W.bpe_explorer_view(explorer, 1024, b"bytes")
    with pytest.raises(ValueError, match=r"max_vocab_size=256: expected at least 257 \(256 bytes \+ 1 special"):
        W.BPEExplorer(SMALL_TEXT, max_vocab_size=256)
    with pytest.raises(ValueError, match="train_text"):
        W.BPEExplorer("")
    with pytest.raises(ValueError, match="heldout_every=1"):
        W.BPEExplorer.from_documents(["a", "b"], heldout_every=1)
    with pytest.raises(ValueError, match="heldout_fraction=1"):
        W.BPEExplorer.from_text(SMALL_TEXT, heldout_fraction=1)
    with pytest.raises(ValueError, match="path="):
        W.BPEExplorer.from_path("/no/such/file.txt")
    with pytest.raises(ValueError, match="step=0"):
        explorer.slider_sizes(0)


def test_text_and_file_sources_and_no_special_tokens(small, tmp_path):
    assert small.max_vocab_size == 300 and small.merges_for(300) == small.merges
    path = tmp_path / "corpus.txt"
    path.write_text(SMALL_TEXT, encoding="utf-8")
    plain = W.BPEExplorer.from_path(path, heldout_fraction=0.25, max_vocab_size=300, special_tokens=[])
    assert plain.min_vocab_size == 256 and plain.train_text + plain.heldout_text == SMALL_TEXT
    assert plain.heldout_text[:1].isspace() and len(plain.heldout_text) <= 0.25 * len(SMALL_TEXT)
    assert W.bpe_explorer_view(plain, 256)["num_merges"] == 0
    assert W.bpe_explorer_view(plain, 300)["heldout_tokens"] == len(plain.tokenizer(300).encode(plain.heldout_text))
    alone = W.BPEExplorer.from_text(SMALL_TEXT, heldout_fraction=0, max_vocab_size=280)
    data = W.bpe_explorer_view(alone, 280)
    assert data["heldout_bytes_per_token"] is None and data["heldout_tokens"] is None and "held out" not in W.explorer_summary(data)
    assert alone.curve()["heldout"] is None
    docs = W.BPEExplorer.from_documents([SMALL_TEXT, SMALL_TEXT[:300], SMALL_HELDOUT], heldout_every=3, max_vocab_size=270)
    assert docs.heldout_text == SMALL_HELDOUT and docs.train_text == SMALL_TEXT + EOT + SMALL_TEXT[:300]
    tiny = W.BPEExplorer("ab ab", max_vocab_size=1000)  # runs out of pairs: the vocabulary stops early
    assert tiny.max_vocab_size < 1000 and tiny.slider_sizes()[-1] == tiny.max_vocab_size


def test_slider_sizes_run_from_the_smallest_to_the_largest_vocabulary(explorer):
    sizes = explorer.slider_sizes(64)
    assert sizes[:3] == [257, 320, 384] and sizes[-2:] == [4032, 4096] and len(sizes) == 1 + (4096 - 320) // 64 + 1


def test_plot_draws_both_curves_and_marks_the_vocabulary(explorer):
    ax = W.plot_compression(explorer, 1024)
    labels = [line.get_label() for line in ax.lines]
    assert labels[:2] == ["training text", "held out"]
    train_line = ax.lines[0]
    assert list(train_line.get_xdata()) == explorer.curve()["vocab_size"]
    assert list(ax.lines[-2].get_ydata()) == [explorer.bytes_per_token(1024)[0]]
    with pytest.raises(ValueError, match="vocab_size=99"):
        W.plot_compression(explorer, 99)


def test_callback_shows_the_panel_and_returns_the_data(explorer, capsys):
    data = W.show_bpe_explorer(700, "hello world", explorer)
    assert data["vocab_size"] == 700 and data["sample"] == "hello world"
    assert "HTML" in capsys.readouterr().out  # IPython's display of the panel, outside a notebook
    assert len(plt.get_fignums()) == 1
    W.show_bpe_explorer(700, None, explorer, plot=False)
    assert len(plt.get_fignums()) == 1


def test_widget_builds(explorer, small):
    assert W.bpe_explorer_widget(explorer) is not None
    assert W.bpe_explorer_widget(small, vocab_size=300, sample="the cat") is not None
