"""Checking final answers of math solutions as text: model output is parsed, never evaluated as code."""

from __future__ import annotations

import re
from fractions import Fraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_final_answer(text: str | None) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` with nested braces matched, or ``None`` (also when unclosed)."""
    starts = [m.end() for m in _BOXED.finditer(text or "")]
    if not starts:
        return None
    depth = 1
    for i in range(starts[-1], len(text)):
        depth += (text[i] == "{") - (text[i] == "}")
        if depth == 0:
            return text[starts[-1] : i].strip()
    return None  # the last box is never closed


def extract_gsm8k_answer(text: str | None) -> str | None:
    """Final answer of a GSM8K worked solution: what follows the last ``####``, or ``None``."""
    return (text.rsplit("####", 1)[1].strip() or None) if text and "####" in text else None


_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mbox|textnormal)\s*\{([^{}]*)\}")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\[dt]?frac\s*(\d)\s*(\d)")
_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)$")


def _outer_braces_match(s: str) -> bool:
    """Whether the ``{`` opening ``s`` is closed by its last character (``{1}{2}`` is not one group)."""
    depth = 0
    for i, ch in enumerate(s):
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            return i == len(s) - 1
    return False


def normalize_answer(answer: str) -> str:
    """Answer text without ``$``, spaces, ``\\left``/``\\right``, units, thousands commas, trailing zeros; ``a/b``."""
    s = answer.strip().replace("\\$", "").replace("$", "").replace("{,}", ",")
    for token in ("\\!", "\\,", "\\;", "\\ ", "\\left", "\\right", "^\\circ", "^{\\circ}", "\\%", "%"):  # in this order
        s = s.replace(token, "")
    # A unit in \text{...} after a value is dropped; a bare \text{word} answer keeps its word.
    s = _TEXT_CMD.sub("", s).strip() or _TEXT_CMD.sub(r"\1", s)
    while s.startswith("{") and s.endswith("}") and _outer_braces_match(s):
        s = s[1:-1].strip()
    s = _FRAC.sub(r"(\1)/(\2)", s)
    s = _FRAC_SHORT.sub(r"\1/\2", s)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"(?<=\d),(?=\d{3}(\D|$))", "", s)  # thousands separators
    s = re.sub(r"\((\-?[\d.]+)\)", r"\1", s)  # (3)/(4) -> 3/4
    s = s.rstrip(".")
    if _NUMBER.match(s) and "." in s:
        s = s.rstrip("0").rstrip(".") or "0"
    return s


def parse_number(answer: str) -> Fraction | None:
    """Exact value of a normalised answer that is an integer, decimal or ``a/b`` fraction, else ``None``."""
    num, slash, den = normalize_answer(answer).partition("/")
    if not _NUMBER.match(num) or (slash and not _NUMBER.match(den)):
        return None
    try:
        return Fraction(num) / Fraction(den if slash else 1)
    except (ValueError, ZeroDivisionError):  # a zero denominator
        return None


def answers_match(prediction: str | None, reference: str | None) -> bool:
    """Whether two final answers agree: as exact numbers when both parse, else as normalised text (never empty)."""
    if prediction is None or reference is None:
        return False
    a, b = normalize_answer(str(prediction)), normalize_answer(str(reference))
    if not a or not b:
        return False
    va, vb = parse_number(a), parse_number(b)
    return va == vb if va is not None and vb is not None else a == b
