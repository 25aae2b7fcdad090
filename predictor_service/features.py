"""Hand-made prompt features for the ``fast`` output-length model.

:func:`extract_features` turns prompts into a dense float matrix whose columns are
:data:`FEATURE_NAMES`. Kinds of feature:

- size: prompt tokens (log), characters, lines, words, the last line's length;
- conversation: turn count;
- question type: ends with "?", starts with a wh-word / an auxiliary verb / a greeting;
- explicit length requests parsed from the text: "in 100 words", "3 paragraphs",
  "5 sentences", "list 10 ideas" / "top 5", "one sentence" / "one word" / "yes or no",
  "brief" / "concise" / "tl;dr", "detailed" / "in-depth" / "step by step";
- task verbs (write, explain, list, translate, summarize, code, rewrite, ...);
- code and markdown markers (fences, braces, keywords, headers, bullets, tables);
- script (writing system) shares: Latin, CJK, kana, Hangul, Cyrillic, Arabic, other.

Instructions sit at the start or the end of a prompt (pasted material sits between),
so the phrase-level patterns look at the first and last ``_EDGE_CHARS`` characters;
counts such as lines and fences use the whole text. Pure and deterministic.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

_EDGE_CHARS = 1000

_NUMBER_WORDS = {
    "a": 1, "an": 1, "one": 1, "single": 1, "two": 2, "three": 3, "four": 4, "five": 5,
    "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12,
    "fifteen": 15, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "hundred": 100,
    "few": 3, "couple": 2, "several": 4,
}  # fmt: skip
_VAGUE_NUMBER_WORDS = frozenset({"a", "an", "single", "few", "couple", "several"})
_NUMBER = r"\b(\d{1,5}(?:,\d{3})?|" + "|".join(sorted(_NUMBER_WORDS, key=len, reverse=True)) + r")"
# Counted things ("a list of items") need a definite number, not "a" or "few".
_DEFINITE_NUMBER = (
    r"\b(\d{1,5}|"
    + "|".join(sorted(set(_NUMBER_WORDS) - _VAGUE_NUMBER_WORDS, key=len, reverse=True))
    + r")"
)

_WORDS_RE = re.compile(_NUMBER + r"[\s-]*(?:to[\s-]*\d+[\s-]*)?words?\b")
_PARAGRAPHS_RE = re.compile(_NUMBER + r"[\s-]*(?:short |long )?paragraphs?\b")
_SENTENCES_RE = re.compile(_NUMBER + r"[\s-]*(?:short |simple )?sentences?\b")
_ITEMS_RE = re.compile(
    _DEFINITE_NUMBER
    + r"[\s-]*(?:\w+[\s-]+){0,2}?(?:items|points|ideas|examples|tips|ways|reasons|questions|"
    r"steps|names|titles|options|bullets?|lines|tweets|slides|headlines|taglines|slogans|"
    r"facts|strategies|topics|suggestions|keywords|quotes|jokes|sections|chapters|days|"
    r"variations|versions|alternatives|prompts|tasks|rules|benefits|features)\b"
)
_TOP_WORDS = ("top", "list", "give me", "generate", "provide", "suggest", "name")
_TOP_RE = re.compile(
    r"\b(?:top|list(?: of)?|give me|generate|provide|suggest|name)\s+" + _DEFINITE_NUMBER + r"\b"
)
_CHARACTERS_RE = re.compile(r"(\d{1,5})[\s-]*(?:characters?|chars?)\b")
_PAGES_RE = re.compile(_NUMBER + r"[\s-]*pages?\b")
_MINUTES_RE = re.compile(_NUMBER + r"[\s-]*minutes?\b")

_FLAG_PATTERNS: tuple[tuple[str, str], ...] = (
    ("very_short_request", r"\bone[\s-](?:word|sentence|line)\b|\ba single[\s-](?:word|sentence|line)\b|"
     r"\b1[\s-](?:word|sentence|line)\b|\byes or no\b|"
     r"\bjust (?:say|answer|reply)\b|\bonly (?:answer|reply|respond)|\breply (?:with|only)\b|"
     r"\backnowledge\b|\bunderstood\b|\bwait for\b|\bdont (?:reply|respond|answer)\b|"
     r"\bdon't (?:reply|respond|answer)\b"),
    ("brief_request", r"\bbrief(?:ly)?\b|\bshort(?:ly|er)?\b|\bconcise(?:ly)?\b|\btl;dr\b|\btldr\b|"
     r"\bin a nutshell\b|\bsuccinct\b|\bquick(?:ly)?\b|\bsimple terms\b"),
    ("detailed_request", r"\bdetail(?:ed|s)?\b|\bcomprehensive\b|\bin-depth\b|\bin depth\b|\belaborat"
     r"|\bthorough|\bextensive|\bstep[\s-]by[\s-]step\b|\blong(?:er)?\b|\bfull\b|\bcomplete\b"),
    ("verb_write", r"\bwrite\b|\bwriting\b|\bdraft\b|\bcompose\b"),
    ("verb_explain", r"\bexplain|\bwhy\b|\bhow does\b|\bwhat is\b|\bwhat are\b|\bdefine\b"),
    ("verb_list", r"\blist\b|\benumerate\b|\bbullet"),
    ("verb_translate", r"\btranslat|\bin english\b|\bin chinese\b|\bin spanish\b|\bin french\b|"
     r"\bin german\b|\bin japanese\b|\bin korean\b"),
    ("verb_summarize", r"\bsummar|\bsum up\b|\bkey points\b|\bmain points\b|\babstract\b"),
    ("verb_code", r"\bcode\b|\bscript\b|\bfunction\b|\bprogram\b|\bimplement|\bpython\b|"
     r"\bjavascript\b|\btypescript\b|\bjava\b|\bsql\b|\bregex\b|\bapi\b|\bhtml\b|\bcss\b|"
     r"\breact\b|\bc\+\+|\bc#|\bbash\b|\bquery\b|\bclass\b|\bcompile"),
    ("verb_rewrite", r"\brewrite\b|\brephrase\b|\bparaphrase\b|\bproofread|\bimprove\b|\bedit\b|"
     r"\bcorrect\b|\bgrammar\b|\bpolish\b|\breword"),
    ("verb_create", r"\bcreate\b|\bgenerate\b|\bmake\b|\bdesign\b|\bplan\b|\bbuild\b|\bdevelop\b"),
    ("verb_describe", r"\bdescribe\b|\bdescription\b|\btell me about\b|\boverview\b"),
    ("verb_compare", r"\bcompare\b|\bcomparison\b|\bdifference|\bversus\b|\bvs\.?\b|\bpros and cons\b"),
    ("verb_suggest", r"\bsuggest|\brecommend|\bideas?\b|\badvice\b|\btips?\b|\bbrainstorm"),
    ("verb_fix", r"\bfix\b|\bdebug|\berror\b|\bbug\b|\bexception\b|\btraceback\b|\bnot working\b"),
    ("verb_continue", r"^\s*continue\b|^\s*go on\b|^\s*keep going\b|^\s*more\b|^\s*next\b"),
    ("genre_long_form", r"\bessay\b|\barticle\b|\bblog\b|\bstory\b|\breport\b|\bchapter\b|"
     r"\bproposal\b|\bcurriculum\b|\bsyllabus\b|\bbusiness plan\b|\bguide\b|\btutorial\b"),
    ("genre_short_form", r"\bpoem\b|\bemail\b|\bletter\b|\btweet\b|\bcaption\b|\btitle\b|"
     r"\bslogan\b|\bheadline\b|\bbio\b|\bsubject line\b|\bhaiku\b|\bjoke\b|\bsong\b|\blyrics\b"),
    ("genre_table", r"\btable\b|\bcsv\b|\bjson\b|\bspreadsheet\b|\bchart\b"),
    ("role_play", r"\bact as\b|\bpretend\b|\byou are an?\b|\bimagine\b|\brole[\s-]?play|\bpersona\b"),
    ("math", r"\bcalculate\b|\bsolve\b|\bequation\b|\bprobability\b|\bderivative\b|\bintegral\b|"
     r"\bmath"),
)  # fmt: skip
_REGEX_META = frozenset("\\[](){}.*+?|^$")
_LEADING_ANCHORS = ("\\b", "^\\s*", "^")


def _split_top_level(pattern: str) -> list[str]:
    """Split a regex on the ``|`` that are outside any group or class."""
    parts, depth, start, index = [], 0, 0, 0
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            index += 2
            continue
        if char in "([":
            depth += 1
        elif char in ")]":
            depth -= 1
        elif char == "|" and depth == 0:
            parts.append(pattern[start:index])
            start = index + 1
        index += 1
    parts.append(pattern[start:])
    return parts


def _required_literals(pattern: str) -> tuple[str, ...] | None:
    """Substrings one of which every match of ``pattern`` contains, or None if unknown.

    Each top-level alternative contributes its leading literal text (after ``\\b`` /
    ``^`` anchors, minus a last character made optional by ``?``/``*``/``{``); an
    alternative that starts with a group or class makes the answer None. Used as a
    cheap ``in`` prefilter: most prompts contain none of a flag's words, and a
    substring test is far cheaper than a regex search.
    """
    literals = []
    for alternative in _split_top_level(pattern):
        for anchor in _LEADING_ANCHORS:
            if alternative.startswith(anchor):
                alternative = alternative[len(anchor) :]
                break
        literal: list[str] = []
        index = 0
        while index < len(alternative):
            char = alternative[index]
            if char == "\\" and index + 1 < len(alternative):
                escaped = alternative[index + 1]
                if escaped.isalnum():  # \b, \s, \d, ...: not a literal character
                    break
                char, index = escaped, index + 1
            elif char in _REGEX_META:
                if char in "?*{" and literal:
                    literal.pop()
                break
            if index + 1 < len(alternative) and alternative[index + 1] in "?*{":
                break  # this character is optional
            literal.append(char)
            index += 1
        if not literal:
            return None
        literals.append("".join(literal))
    return tuple(literals)


_FLAG_RES = tuple(
    (name, re.compile(pattern), _required_literals(pattern)) for name, pattern in _FLAG_PATTERNS
)


def _flag_present(pattern: re.Pattern[str], literals: tuple[str, ...] | None, text: str) -> bool:
    if literals is not None and not any(literal in text for literal in literals):
        return False
    return pattern.search(text) is not None


_WH_START_RE = re.compile(r"^\s*(?:what|why|how|when|where|who|whom|whose|which)\b")
_AUX_START_RE = re.compile(
    r"^\s*(?:is|are|was|were|can|could|do|does|did|will|would|should|shall|may|might|has|have)\b"
)
_GREETING_RE = re.compile(
    r"^\s*(?:hi|hello|hey|good (?:morning|evening|afternoon)|thanks|thank you)\b"
)
_IMPERATIVE_START_RE = re.compile(
    r"^\s*(?:please\s+)?(?:write|explain|list|translate|summari[sz]e|create|generate|make|give|"
    r"tell|describe|provide|help|rewrite|suggest|design|compare|show|find|act|imagine|build)\b"
)
# Substrings typical of source code; counted with str.count (a regex alternation over
# these was the single slowest feature).
_CODE_MARKERS = (
    "def ", "class ", "import ", "#include", "function", "=>", "return", "const ", "var ",
    "let ", "SELECT ", "console.", "print(", "</", "/>", "();", "){", "self.", "this.",
)  # fmt: skip
_URL_RE = re.compile(r"https?://")
_HEADER_LINE_RE = re.compile(r"^#", re.MULTILINE)
_BULLET_LINE_RE = re.compile(r"^[ \t]*(?:[-*•]|\d{1,2}[.)]) ", re.MULTILINE)
_TABLE_LINE_RE = re.compile(r"^[^\n]*\|[^\n]*\|", re.MULTILINE)

_SCRIPT_RANGES: tuple[tuple[str, tuple[tuple[int, int], ...]], ...] = (
    ("latin", ((0x41, 0x5A), (0x61, 0x7A), (0xC0, 0x24F))),
    ("cjk", ((0x3400, 0x4DBF), (0x4E00, 0x9FFF))),
    ("kana", ((0x3040, 0x30FF),)),
    ("hangul", ((0xAC00, 0xD7AF), (0x1100, 0x11FF))),
    ("cyrillic", ((0x400, 0x4FF),)),
    ("arabic", ((0x600, 0x6FF),)),
)

_LENGTH_REQUEST_NAMES = (
    "requested_words", "requested_paragraphs", "requested_sentences", "requested_items",
    "requested_characters", "requested_pages", "requested_minutes",
)  # fmt: skip

FEATURE_NAMES: tuple[str, ...] = (
    "log_prompt_tokens", "log_prompt_chars", "log_num_lines", "log_num_words",
    "log_last_line_chars", "chars_per_token", "num_turns",
    "ends_with_question", "num_question_marks", "starts_wh", "starts_aux", "starts_greeting",
    "starts_imperative",
    *_LENGTH_REQUEST_NAMES,
    *(name for name, _ in _FLAG_PATTERNS),
    "num_code_fences", "code_keyword_density", "brace_density", "markdown_headers",
    "bullet_lines", "table_lines", "num_urls", "digit_share", "upper_share",
    *(f"script_{name}" for name, _ in _SCRIPT_RANGES), "script_other",
)  # fmt: skip
NUM_FEATURES = len(FEATURE_NAMES)


def _parse_number(text: str) -> float:
    value = _NUMBER_WORDS.get(text)
    if value is not None:
        return float(value)
    return float(text.replace(",", ""))


def _largest_request(pattern: re.Pattern[str], text: str, cap: float) -> float:
    """Largest number the pattern captures in ``text`` (0 when none), capped."""
    best = 0.0
    for match in pattern.finditer(text):
        best = max(best, _parse_number(match.group(1)))
    return min(best, cap)


def _largest_request_if(keyword: str, pattern: re.Pattern[str], text: str, cap: float) -> float:
    """:func:`_largest_request`, skipped (0) when ``keyword`` is absent (a cheap prefilter)."""
    return _largest_request(pattern, text, cap) if keyword in text else 0.0


def _largest_request_if_any(
    keywords: tuple[str, ...], pattern: re.Pattern[str], text: str, cap: float
) -> float:
    """:func:`_largest_request`, skipped (0) when none of ``keywords`` occurs."""
    if not any(keyword in text for keyword in keywords):
        return 0.0
    return _largest_request(pattern, text, cap)


def _length_requests(edge_lower: str) -> list[float]:
    items = max(
        _largest_request(_ITEMS_RE, edge_lower, 1000.0),
        _largest_request_if_any(_TOP_WORDS, _TOP_RE, edge_lower, 1000.0),
    )
    return [
        _largest_request_if("word", _WORDS_RE, edge_lower, 20000.0),
        _largest_request_if("paragraph", _PARAGRAPHS_RE, edge_lower, 100.0),
        _largest_request_if("sentence", _SENTENCES_RE, edge_lower, 100.0),
        items,
        _largest_request_if("char", _CHARACTERS_RE, edge_lower, 100000.0),
        _largest_request_if("page", _PAGES_RE, edge_lower, 100.0),
        _largest_request_if("minute", _MINUTES_RE, edge_lower, 600.0),
    ]


def _in_ranges(code_points: npt.NDArray[np.uint32], ranges: tuple[tuple[int, int], ...]) -> int:
    mask = np.zeros(code_points.shape, dtype=bool)
    for low, high in ranges:
        mask |= (code_points >= low) & (code_points <= high)
    return int(mask.sum())


_DIGIT_BYTES = b"0123456789"
_UPPER_BYTES = bytes(range(65, 91))
_LETTER_BYTES = bytes(range(65, 91)) + bytes(range(97, 123))


def _ascii_character_shares(edge: str) -> list[float]:
    """:func:`_character_shares` for pure-ASCII text: counts by ``bytes.translate``."""
    data = edge.encode("ascii")
    num_chars = max(len(data), 1)
    num_digits = len(data) - len(data.translate(None, _DIGIT_BYTES))
    num_upper = len(data) - len(data.translate(None, _UPPER_BYTES))
    num_letters = len(data) - len(data.translate(None, _LETTER_BYTES))
    latin_share = 1.0 if num_letters else 0.0
    num_other_scripts = len(_SCRIPT_RANGES)  # latin, then the others, then "other"
    return [num_digits / num_chars, num_upper / num_chars, latin_share] + [0.0] * num_other_scripts


def _character_shares(edge: str) -> list[float]:
    """Digit and upper-case shares of ``edge`` and the script shares of its letters.

    Vectorised over code points (numpy) because a per-character Python loop dominated
    the feature cost. "Letters" are the Latin letters plus every code point of the
    other scripts' ranges; ``script_other`` counts code points >= U+0370 outside all
    named ranges and outside punctuation/symbol blocks (U+2000-U+2BFF, emoji).
    """
    if edge.isascii():
        return _ascii_character_shares(edge)
    code_points = np.frombuffer(edge.encode("utf-32-le"), dtype=np.uint32)
    num_chars = max(len(code_points), 1)
    num_digits = int(((code_points >= 48) & (code_points <= 57)).sum())
    num_upper = int(((code_points >= 65) & (code_points <= 90)).sum())
    script_counts = [_in_ranges(code_points, ranges) for _, ranges in _SCRIPT_RANGES]
    non_ascii = code_points[code_points >= 0x370]
    symbol_like = ((non_ascii >= 0x2000) & (non_ascii <= 0x2BFF)) | (non_ascii >= 0x1F000)
    num_other = max(len(non_ascii) - int(symbol_like.sum()) - sum(script_counts[1:]), 0)
    num_letters = max(sum(script_counts) + num_other, 1)
    shares = [count / num_letters for count in script_counts]
    return [num_digits / num_chars, num_upper / num_chars, *shares, num_other / num_letters]


def _prompt_features(prompt: str, prompt_tokens: int, num_turns: int) -> list[float]:
    num_chars = len(prompt)
    if num_chars > 2 * _EDGE_CHARS:
        edge = prompt[:_EDGE_CHARS] + "\n" + prompt[-_EDGE_CHARS:]
    else:
        edge = prompt
    edge_lower = edge.lower()
    stripped = prompt.strip()
    num_lines = prompt.count("\n") + 1
    last_line = stripped.rsplit("\n", 1)[-1] if stripped else ""
    num_words = len(prompt.split())
    safe_chars = max(num_chars, 1)
    first_line_lower = edge_lower.lstrip()[:200]
    features = [
        math.log1p(prompt_tokens),
        math.log1p(num_chars),
        math.log1p(num_lines),
        math.log1p(num_words),
        math.log1p(len(last_line)),
        num_chars / max(prompt_tokens, 1),
        float(num_turns),
        float(stripped.endswith("?")),
        float(min(prompt.count("?"), 50)),
        float(_WH_START_RE.match(first_line_lower) is not None),
        float(_AUX_START_RE.match(first_line_lower) is not None),
        float(_GREETING_RE.match(first_line_lower) is not None),
        float(_IMPERATIVE_START_RE.match(first_line_lower) is not None),
    ]
    features.extend(_length_requests(edge_lower))
    features.extend(
        float(_flag_present(pattern, literals, edge_lower)) for _, pattern, literals in _FLAG_RES
    )
    features.extend(
        [
            float(min(prompt.count("```"), 50)),
            sum(edge.count(marker) for marker in _CODE_MARKERS) / (len(edge) / 100.0 + 1.0),
            (prompt.count("{") + prompt.count("}") + prompt.count(";")) / safe_chars * 100.0,
            float(len(_HEADER_LINE_RE.findall(prompt))),
            float(len(_BULLET_LINE_RE.findall(prompt))),
            float(len(_TABLE_LINE_RE.findall(prompt))),
            float(len(_URL_RE.findall(prompt))),
        ]
    )
    features.extend(_character_shares(edge))
    return features


def extract_features(
    prompts: Sequence[str], prompt_tokens: Sequence[int], num_turns: Sequence[int]
) -> npt.NDArray[np.float32]:
    """Return an ``(len(prompts), NUM_FEATURES)`` float32 matrix, columns :data:`FEATURE_NAMES`.

    The three sequences must have equal length (``ValueError`` otherwise).
    """
    if not len(prompts) == len(prompt_tokens) == len(num_turns):
        raise ValueError("prompts, prompt_tokens and num_turns must have equal length")
    matrix = np.empty((len(prompts), NUM_FEATURES), dtype=np.float32)
    for row, (prompt, num_prompt_tokens, turns) in enumerate(
        zip(prompts, prompt_tokens, num_turns, strict=True)
    ):
        matrix[row] = _prompt_features(prompt, int(num_prompt_tokens), int(turns))
    return matrix
