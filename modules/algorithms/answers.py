"""Checking final answers of math solutions as text: model output is parsed, never evaluated as code."""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["answers_match", "extract_final_answer", "extract_gsm8k_answer", "normalize_answer", "parse_number"]

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_final_answer(text: str | None) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` with nested braces matched, or ``None`` (also when unclosed)."""
    if not text:
        return None
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            ch = text[i]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
        return None  # the last box is never closed
    return None


def extract_gsm8k_answer(text: str | None) -> str | None:
    """Final answer of a GSM8K worked solution: what follows the last ``####``, or ``None``."""
    return (text.rsplit("####", 1)[1].strip() or None) if text and "####" in text else None


_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mbox|textnormal)\s*\{[^{}]*\}")
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
    s = answer.strip()
    s = (
        s.replace("\\$", "")
        .replace("$", "")
        .replace("{,}", ",")
        .replace("\\!", "")
        .replace("\\,", "")
        .replace("\\;", "")
        .replace("\\ ", "")
    )
    s = s.replace("\\left", "").replace("\\right", "").replace("^\\circ", "").replace("^{\\circ}", "")
    s = s.replace("\\%", "").replace("%", "")
    # A unit in \text{...} after a value is dropped; a bare \text{word} answer keeps its word.
    stripped = _TEXT_CMD.sub("", s).strip()
    if stripped:
        s = stripped
    else:
        s = re.sub(r"\\(?:text|textbf|mathrm|mbox|textnormal)\s*\{([^{}]*)\}", r"\1", s)
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
    s = normalize_answer(answer)
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            if not (_NUMBER.match(num) and _NUMBER.match(den)):
                return None
            den_v = Fraction(den)
            return None if den_v == 0 else Fraction(num) / den_v
        if _NUMBER.match(s):
            return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
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
