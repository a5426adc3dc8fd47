"""IFEval's verifiable instructions (Zhou et al., 2023), checked offline; strict and loose following.

The Stackelberg paper's App. G.5 scores its Followers on IFEval. Each checker follows the benchmark's rule, written
anew to need no downloads: punkt's English data (the reference's sentences and ``word_tokenize``) ships in no PyPI
package, so :func:`split_sentences` and :func:`word_tokens` are rule-based equivalents, tested on the reference's cases.
Keywords and section splitters match literally; ``langdetect`` is seeded, an undetectable language counting as
following. An id outside :data:`CHECKERS` is not guessed (:func:`is_supported`).
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

RELATIONS = ("less than", "at least")
CONSTRAINED_OPTIONS = ("My answer is yes.", "My answer is no.", "My answer is maybe.")

_ABBREVIATIONS = (
    "Ph\\.D|Mr|Mrs|Ms|Dr|Prof|Capt|Cpt|Lt|Col|Gen|Sgt|St|Sr|Jr|Mt|Ft|Inc|Ltd|Co|Corp|vs|etc|approx|No|Vol|Fig|Jan|Feb|Mar"
    "|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec"
)
_PRD, _STOP = "\x00", "\x01"  # placeholders for a protected period and a sentence end


def split_sentences(text: str) -> list[str]:
    """Split ``text`` into sentences at ``.``, ``!`` and ``?``, keeping periods that do not end one.

    A period stays inside a sentence after a title or common abbreviation (``Dr.``, ``Ph.D.``), an initial (a word of
    single letters each with a period: ``J.``, ``e.g.``, ``U.S.``, not the ``x.`` of ``xx,x.``, as punkt's tokens go),
    between digits, before a web domain, and within an ellipsis (which ends a sentence only once).
    """
    t = " " + text.replace("\n", " ") + " "
    t = re.sub(r"\b(" + _ABBREVIATIONS + r")\.", lambda m: m.group(1) + _PRD, t, flags=re.IGNORECASE)
    t = re.sub(r"(?<=\d)\.(?=\d)|\.(?=(?:com|net|org|io|gov|edu|me|uk|de)\b)", _PRD, t)  # 3.50, example.com
    t = re.sub(r"\.{2,}", lambda m: _PRD * (len(m.group(0)) - 1) + ".", t)  # an ellipsis: one possible end
    t = re.sub(r"(?<![^\s(\[\"'“‘])(?:[A-Za-z]\.)+", lambda m: m.group(0).replace(".", _PRD), t)  # initials
    t = re.sub(r"([.!?]+)([\"'”’)\]]*)(?=\s|$)", lambda m: m.group(1) + m.group(2) + _STOP, t)
    return [s.replace(_PRD, ".").strip() for s in t.split(_STOP) if s.replace(_PRD, ".").strip()]


def count_words(text: str) -> int:
    r"""The number of ``\w+`` runs (the benchmark's ``RegexpTokenizer(r"\w+")``)."""
    return len(re.findall(r"\w+", text))


def _compare(count: int, relation: str, threshold: int) -> bool:
    return count < threshold if relation == RELATIONS[0] else count >= threshold


def _language(text: str) -> str | None:
    """``langdetect``'s language code for ``text``; ``None`` when it cannot tell (no letters, say)."""
    try:
        from langdetect import DetectorFactory, LangDetectException, detect
    except ImportError as err:  # pragma: no cover - the games extra installs it
        raise ImportError("IFEval's language checks need langdetect: pip install -e '.[games]'") from err
    DetectorFactory.seed = 0  # langdetect samples; a fixed seed makes each answer repeatable
    try:
        return detect(text)
    except LangDetectException:
        return None


def _in_language(text: str, code: str) -> bool:
    found = _language(text)
    return found is None or found == code  # undetectable counts as following, as in the benchmark


def word_tokens(text: str) -> list[str]:
    """Words as ``nltk.word_tokenize`` splits them, by Treebank's rules without punkt's sentence split."""
    # at spaces , ; : @ # $ % & ? ! quotes brackets, before n't 'll 're 've 'm 's 'd and can|not; not at . - / (U.S.A.)
    t = re.sub(r"(?i)(n't|'(?:ll|re|ve|m|s|d))\b", r" \1", re.sub(r"(?i)\b(can)(not)\b", r"\1 \2", text))
    return re.findall(r"[^\s,;:@#$%&?!\"“”(){}\[\]<>]+", t)


def _capital_word_frequency(r: str, kw: Mapping[str, Any]) -> bool:
    return _compare(sum(w.isupper() for w in word_tokens(r)), kw["capital_relation"], kw["capital_frequency"])


def _parts(r: str, separator: str) -> list[str] | None:
    """The stripped parts of ``r`` between separators, blank ends dropped; ``None`` when an inner one is blank."""
    parts = [p.strip() for p in re.split(separator, r)]
    return None if not all(parts[1:-1]) else [p for p in parts if p]


def _two_responses(r: str, kw: Mapping[str, Any]) -> bool:
    kept = _parts(r, re.escape("******"))
    return kept is not None and len(kept) == 2 and kept[0] != kept[1]


_POSTSCRIPTS = {"P.P.S": r"\s*p\.\s?p\.\s?s.*$", "P.S.": r"\s*p\.\s?s\..*$"}  # the benchmark's own patterns


def _postscript(r: str, kw: Mapping[str, Any]) -> bool:
    marker = kw["postscript_marker"].strip()
    pattern = _POSTSCRIPTS.get(marker, r"\s*" + re.escape(marker.lower()) + r".*$")
    return bool(re.findall(pattern, r.lower(), flags=re.MULTILINE))


def _json_format(r: str, kw: Mapping[str, Any]) -> bool:
    value = r.strip()
    for fence in ("```json", "```Json", "```JSON", "```"):
        value = value.removeprefix(fence)
    value = value.removesuffix("```").strip()
    try:
        json.loads(value)
    except ValueError:
        return False
    return True


def _multiple_sections(r: str, kw: Mapping[str, Any]) -> bool:
    splitter = re.escape(kw["section_spliter"].strip())
    return len(re.split(r"\s?" + splitter + r"\s?\d+\s?", r)) - 1 >= kw["num_sections"]


def _bullet_lists(r: str, kw: Mapping[str, Any]) -> bool:
    stars = re.findall(r"^\s*\*[^\*].*$", r, flags=re.MULTILINE)
    dashes = re.findall(r"^\s*-.*$", r, flags=re.MULTILINE)
    return len(stars) + len(dashes) == kw["num_bullets"]


def _highlighted_sections(r: str, kw: Mapping[str, Any]) -> bool:
    single = [h for h in re.findall(r"\*[^\n\*]*\*", r) if h.strip("*").strip()]
    double = [h for h in re.findall(r"\*\*[^\n\*]*\*\*", r) if h.removeprefix("**").removesuffix("**").strip()]
    return len(single) + len(double) >= kw["num_highlights"]


def _title(r: str, kw: Mapping[str, Any]) -> bool:
    return any(t.lstrip("<").rstrip(">").strip() for t in re.findall(r"<<[^\n]+>>", r))


def _existence(r: str, kw: Mapping[str, Any]) -> bool:
    return all(re.search(re.escape(k), r, flags=re.IGNORECASE) for k in kw["keywords"])


def _forbidden(r: str, kw: Mapping[str, Any]) -> bool:
    return not any(re.search(r"\b" + re.escape(w) + r"\b", r, flags=re.IGNORECASE) for w in kw["forbidden_words"])


def _keyword_frequency(r: str, kw: Mapping[str, Any]) -> bool:
    found = len(re.findall(re.escape(kw["keyword"].strip()), r, flags=re.IGNORECASE))
    return _compare(found, kw["relation"], kw["frequency"])


def _letter_frequency(r: str, kw: Mapping[str, Any]) -> bool:
    letters = collections.Counter(r.lower())
    return _compare(letters[kw["letter"].strip().lower()], kw["let_relation"], kw["let_frequency"])


def _nth_paragraph_first_word(r: str, kw: Mapping[str, Any]) -> bool:
    paragraphs = re.split(r"\n\n", r)
    count = sum(1 for p in paragraphs if p.strip())
    nth = kw["nth_paragraph"]
    if nth > count or not paragraphs[nth - 1].strip():  # the benchmark indexes the split, empty parts included
        return False
    word = paragraphs[nth - 1].strip().split()[0].lstrip("'").lstrip('"')
    first = re.match(r"[^.,?!'\"]*", word).group(0).lower()
    return count == kw["num_paragraphs"] and first == kw["first_word"].lower()


def _paragraphs(r: str, kw: Mapping[str, Any]) -> bool:
    kept = _parts(r, r"\s?\*\*\*\s?")  # an empty paragraph between two dividers fails
    return kept is not None and len(kept) == kw["num_paragraphs"]


def _end_checker(r: str, kw: Mapping[str, Any]) -> bool:
    return r.strip().strip('"').lower().endswith(kw["end_phrase"].strip().lower())


def _quotation(r: str, kw: Mapping[str, Any]) -> bool:
    value = r.strip()
    return len(value) > 1 and value[0] == '"' and value[-1] == '"'


#: instruction id -> (check(response, kwargs) -> followed, the kwargs it needs)
_TABLE: dict[str, tuple[Callable[[str, Mapping[str, Any]], bool], tuple[str, ...]]] = {
    "change_case:capital_word_frequency": (_capital_word_frequency, ("capital_frequency", "capital_relation")),
    "change_case:english_capital": (lambda r, kw: r.isupper() and _in_language(r, "en"), ()),
    "change_case:english_lowercase": (lambda r, kw: r.islower() and _in_language(r, "en"), ()),
    "combination:repeat_prompt": (
        lambda r, kw: r.strip().lower().startswith(kw["prompt_to_repeat"].strip().lower()),
        ("prompt_to_repeat",),
    ),
    "combination:two_responses": (_two_responses, ()),
    "detectable_content:number_placeholders": (
        lambda r, kw: len(re.findall(r"\[.*?\]", r)) >= kw["num_placeholders"],
        ("num_placeholders",),
    ),
    "detectable_content:postscript": (_postscript, ("postscript_marker",)),
    "detectable_format:constrained_response": (lambda r, kw: any(o in r.strip() for o in CONSTRAINED_OPTIONS), ()),
    "detectable_format:json_format": (_json_format, ()),
    "detectable_format:multiple_sections": (_multiple_sections, ("section_spliter", "num_sections")),
    "detectable_format:number_bullet_lists": (_bullet_lists, ("num_bullets",)),
    "detectable_format:number_highlighted_sections": (_highlighted_sections, ("num_highlights",)),
    "detectable_format:title": (_title, ()),
    "keywords:existence": (_existence, ("keywords",)),
    "keywords:forbidden_words": (_forbidden, ("forbidden_words",)),
    "keywords:frequency": (_keyword_frequency, ("keyword", "frequency", "relation")),
    "keywords:letter_frequency": (_letter_frequency, ("letter", "let_frequency", "let_relation")),
    "language:response_language": (lambda r, kw: _in_language(r, kw["language"]), ("language",)),
    "length_constraints:nth_paragraph_first_word": (
        _nth_paragraph_first_word,
        ("num_paragraphs", "nth_paragraph", "first_word"),
    ),
    "length_constraints:number_paragraphs": (_paragraphs, ("num_paragraphs",)),
    "length_constraints:number_sentences": (
        lambda r, kw: _compare(len(split_sentences(r)), kw["relation"], kw["num_sentences"]),
        ("num_sentences", "relation"),
    ),
    "length_constraints:number_words": (
        lambda r, kw: _compare(count_words(r), kw["relation"], kw["num_words"]),
        ("num_words", "relation"),
    ),
    "punctuation:no_comma": (lambda r, kw: "," not in r, ()),
    "startend:end_checker": (_end_checker, ("end_phrase",)),
    "startend:quotation": (_quotation, ()),
}
#: the supported instruction ids and their checks
CHECKERS = {k: v[0] for k, v in _TABLE.items()}
#: the kwargs each supported id needs
REQUIRED_KWARGS = {k: v[1] for k, v in _TABLE.items()}
_INT_KWARGS = set(
    "capital_frequency num_placeholders num_sections num_bullets num_highlights frequency "
    "let_frequency num_paragraphs nth_paragraph num_sentences num_words".split()
)
_RELATION_KWARGS = {"relation", "capital_relation", "let_relation"}
_LIST_KWARGS = {"keywords", "forbidden_words"}


def is_supported(instruction_id: str) -> bool:
    """Whether :data:`CHECKERS` has a check for ``instruction_id``."""
    return instruction_id in CHECKERS


def check_kwargs(instruction_id: str, kwargs: Mapping[str, Any]) -> None:
    """Refuse kwargs a supported instruction cannot be checked with, naming the field.

    Raises:
        KeyError: for an unsupported ``instruction_id``.
        ValueError: for a missing kwarg or one of the wrong type or range.
    """
    for field in REQUIRED_KWARGS[instruction_id]:
        value = kwargs.get(field)
        if value is None:
            raise ValueError(f"kwargs.{field} is missing (instruction {instruction_id!r} needs it)")
        if field in _INT_KWARGS:
            low = 1 if field == "nth_paragraph" else 0
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"kwargs.{field} must be an integer >= {low}, got {value!r}")
        elif field in _RELATION_KWARGS:
            if value not in RELATIONS:
                raise ValueError(f"kwargs.{field} must be one of {RELATIONS}, got {value!r}")
        elif field in _LIST_KWARGS:
            if not isinstance(value, list) or not value or not all(isinstance(w, str) and w for w in value):
                raise ValueError(f"kwargs.{field} must be a non-empty list of non-empty strings, got {value!r}")
        elif not isinstance(value, str) or not value.strip():
            raise ValueError(f"kwargs.{field} must be a non-empty string, got {value!r}")
        elif field == "letter" and len(value.strip()) != 1:
            raise ValueError(f"kwargs.letter must be one character, got {value!r}")


def loose_variants(response: str) -> list[str]:
    """IFEval's 8 loose variants: the response without its first, last or both lines, each also without ``*``."""
    lines = response.split("\n")
    cut = [response, "\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(), "\n".join(lines[1:-1]).strip()]
    return [cut[0], cut[0].replace("*", ""), *cut[1:], *(c.replace("*", "") for c in cut[1:])]


def follows(instruction_id: str, kwargs: Mapping[str, Any], response: str, loose: bool = False) -> bool:
    """Whether ``response`` follows the instruction, strictly or (``loose``) in any non-blank :func:`loose_variants`.

    Raises:
        KeyError: for an unsupported ``instruction_id`` (check :func:`is_supported` first).
    """
    check = CHECKERS[instruction_id]
    candidates = loose_variants(response) if loose else [response]
    return any(c.strip() and check(c, kwargs) for c in candidates)
