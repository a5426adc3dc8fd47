"""IFEval's instruction checkers on hand-written responses: each passes one and fails another, strict vs loose."""

import pytest

from alignment_games.modules.algorithms.ifeval_checks import (
    CHECKERS,
    check_kwargs,
    count_words,
    follows,
    is_supported,
    loose_variants,
    split_sentences,
    word_tokens,
)

# The 25 instruction ids of IFEval's input_data.jsonl (541 prompts, 834 instructions), most frequent first.
IFEVAL_IDS = [
    "punctuation:no_comma",
    "length_constraints:number_words",
    "length_constraints:number_sentences",
    "keywords:forbidden_words",
    "detectable_format:number_highlighted_sections",
    "keywords:frequency",
    "combination:repeat_prompt",
    "startend:quotation",
    "change_case:english_lowercase",
    "keywords:existence",
    "detectable_format:title",
    "keywords:letter_frequency",
    "detectable_format:number_bullet_lists",
    "language:response_language",
    "detectable_content:number_placeholders",
    "length_constraints:number_paragraphs",
    "startend:end_checker",
    "detectable_content:postscript",
    "change_case:english_capital",
    "change_case:capital_word_frequency",
    "combination:two_responses",
    "detectable_format:json_format",
    "detectable_format:multiple_sections",
    "length_constraints:nth_paragraph_first_word",
    "detectable_format:constrained_response",
]

EN = "The weather is lovely today and we are going for a long walk in the park near the river."
# (id, kwargs, a response that follows, one that does not)
CASES = [
    ("punctuation:no_comma", {}, "No commas here at all.", "Well, a comma."),
    ("length_constraints:number_words", {"num_words": 5, "relation": "at least"}, "one two three four five", "a b c"),
    ("length_constraints:number_words", {"num_words": 5, "relation": "less than"}, "one two three four", "a b c d e"),
    (
        "length_constraints:number_sentences",
        {"num_sentences": 3, "relation": "less than"},
        "Dr. Smith paid $3.50. He left!",
        "One. Two. Three?",
    ),
    (
        "length_constraints:number_sentences",
        {"num_sentences": 2, "relation": "at least"},
        "It is e.g. fine. Yes.",
        "Mr. J. R. R. Tolkien wrote at example.com etc. and more...",
    ),
    ("keywords:forbidden_words", {"forbidden_words": ["cat", "dog"]}, "A category of dogs.", "My Cat sleeps."),
    (
        "detectable_format:number_highlighted_sections",
        {"num_highlights": 2},
        "*one* and **two**",
        "*one* and ** ** and *\n*",
    ),
    ("keywords:frequency", {"keyword": "tea", "frequency": 3, "relation": "at least"}, "Tea, tea, TEAM", "tea tea"),
    ("keywords:frequency", {"keyword": "tea", "frequency": 2, "relation": "less than"}, "one tea", "tea and tea"),
    (
        "combination:repeat_prompt",
        {"prompt_to_repeat": "Write a poem."},
        "  write a POEM. Roses are red.",
        "Sure! Write a poem.",
    ),
    ("startend:quotation", {}, ' "All of it quoted" ', '"Only the start'),
    ("change_case:english_lowercase", {}, EN.lower(), EN),
    ("keywords:existence", {"keywords": ["river", "park"]}, EN, "The river only."),
    ("detectable_format:title", {}, "<<A Poem>>\nlines", "<< >> and <<no\nnewline>>"),
    ("keywords:letter_frequency", {"letter": "z", "let_frequency": 2, "let_relation": "at least"}, "Zz top", "zero"),
    ("keywords:letter_frequency", {"letter": "a", "let_frequency": 3, "let_relation": "less than"}, "Aa", "A a a"),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* one\n- two\n**bold**", "* one\n* two\n* three"),
    ("language:response_language", {"language": "de"}, "Das Wetter ist heute sehr schön und wir gehen spazieren.", EN),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "[name] lives at [address]", "[name] only"),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "One\n***\nTwo\n***", "One\n***\n\n***\nTwo"),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, 'Done. any other questions?"', "Any other? no"),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "Body\np. p. s. more", "Body\nP.S. more"),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Body\nP.S. note", "Body\nPS note"),
    ("change_case:english_capital", {}, EN.upper(), EN),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 2, "capital_relation": "at least"},
        "The AI-DRIVEN NASA plan",
        "The AI-driven plan",
    ),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 2, "capital_relation": "less than"},
        "One NASA plan",
        "NASA and ESA",
    ),
    ("combination:two_responses", {}, "First answer.\n******\nSecond answer.", "Same.\n******\nSame."),
    ("detectable_format:json_format", {}, '```json\n{"a": [1, 2]}\n```', "{'a': 1}"),
    (
        "detectable_format:multiple_sections",
        {"section_spliter": "Section", "num_sections": 2},
        "Section 1\nhi\nSection 2\nbye",
        "Section 1\nhi\nsection 2",
    ),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "Then"},
        'First part.\n\n"Then, the second.',
        "First part.\n\nNext the second.",
    ),
    ("detectable_format:constrained_response", {}, "Well... My answer is maybe.", "My answer is: yes."),
]


def test_every_ifeval_id_has_a_checker_and_a_case():
    assert sorted(CHECKERS) == sorted(IFEVAL_IDS) and len(IFEVAL_IDS) == 25
    assert {c[0] for c in CASES} == set(IFEVAL_IDS)
    assert all(is_supported(i) for i in IFEVAL_IDS) and not is_supported("keywords:unknown")


@pytest.mark.parametrize(("iid", "kwargs", "good", "bad"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_checker_passes_and_fails_by_hand(iid, kwargs, good, bad):
    check_kwargs(iid, kwargs)
    assert follows(iid, kwargs, good) is True
    assert follows(iid, kwargs, bad) is False


def test_blank_responses_never_follow():
    # "less than 5 words" holds for an empty string, but IFEval counts a blank response as not following
    assert not follows("length_constraints:number_words", {"num_words": 5, "relation": "less than"}, "  \n")
    assert not follows("punctuation:no_comma", {}, "", loose=True)


def test_loose_variants_are_the_eight_of_ifeval():
    response = "Sure:\n**body** text\nHope this helps"
    assert loose_variants(response) == [
        response,
        "Sure:\nbody text\nHope this helps",
        "**body** text\nHope this helps",
        "Sure:\n**body** text",
        "**body** text",
        "body text\nHope this helps",
        "Sure:\nbody text",
        "body text",
    ]


def test_strict_and_loose_differ_on_a_hand_case():
    quoted = 'Here is my answer:\n"All of the answer, quoted."'
    assert not follows("startend:quotation", {}, quoted) and follows("startend:quotation", {}, quoted, loose=True)
    ending = {"end_phrase": "Is there anything else I can help with?"}
    starred = "Text.\n**Is there anything else I can help with?**"
    assert not follows("startend:end_checker", ending, starred)  # ends with **
    assert follows("startend:end_checker", ending, starred, loose=True)  # the * removed
    # loose never rescues what no variant satisfies
    assert not follows("punctuation:no_comma", {}, "a, b\nc, d\ne, f", loose=True)
    assert follows("punctuation:no_comma", {}, "Intro, with a comma\nbody\nOutro, too", loose=True)  # both lines cut


def test_sentences_and_words_by_hand():
    assert split_sentences("Dr. Smith paid $3.50 at example.com... Then he left! Did he?") == [
        "Dr. Smith paid $3.50 at example.com...",
        "Then he left!",
        "Did he?",
    ]
    assert split_sentences('He said "stop." Then the U.S. team won.') == ['He said "stop."', "Then the U.S. team won."]
    assert split_sentences("no end mark") == ["no end mark"] and split_sentences("  ") == []
    assert count_words("It's a well-known fact: 3.5 apples!") == 9  # It s a well known fact 3 5 apples


@pytest.mark.parametrize(
    ("text", "sentences"),
    [  # google-research instruction_following_eval's own cases: instructions_util_test (count_sentences, punkt) and
        # instructions_test (number_sentences), where "x." after "," "/" "|" or "}" ends a sentence, unlike an initial
        ("xx,x. xx,x! xx/x. x{x}x? x.", 5),
        ("xx,x! xxxx. x(x)x?", 3),
        ("xxxx. xx,x! xx|x. x&x x?", 4),
        ("xx-x]xx,x! x{x}xx,x.", 2),
        ("xx,x. xx,x! xx/x. x{x}x?", 4),
        ("xx-x. xx,x! xx}x. x,xx?", 4),
    ],
)
def test_sentence_count_matches_the_reference_cases(text, sentences):
    assert len(split_sentences(text)) == sentences
    kwargs = {"num_sentences": sentences, "relation": "at least"}
    assert follows("length_constraints:number_sentences", kwargs, text)
    assert not follows("length_constraints:number_sentences", {**kwargs, "num_sentences": sentences + 1}, text)


def test_sentence_split_matches_the_reference_splitter():
    """instructions_util_test's two split cases (its regex splitter, which agrees with punkt on them)."""
    text = "Google is a technology company. It was founded in 1998 by Larry Page\nand Sergey Brin. Google's mission."
    assert split_sentences(text) == [
        "Google is a technology company.",
        "It was founded in 1998 by Larry Page and Sergey Brin.",
        "Google's mission.",
    ]
    text = "The U.S.A has many Ph.D. students. They will often haven a .com website\nsharing the research."
    assert split_sentences(text) == [
        "The U.S.A has many Ph.D. students.",
        "They will often haven a .com website sharing the research.",
    ]


@pytest.mark.parametrize(
    ("text", "capitals"),
    [  # instructions_test's capital_word_frequency messages: at least 3, and less than 5
        ("HERE there are THREE FUlly CAPITAL words.", 3),
        ("THERE are Four FULLY CAPITAL WORDS. Many Others Are Only Partially So.", 4),
        # nltk.word_tokenize's Treebank splits: a dotted acronym and a slash stay one word, contractions split
        ("U.S.A. and the U.K.", 2),  # \w+ words counted 5
        ("DON'T STOP", 3),  # DO, N'T, STOP
        ("NASA's A/B TEST", 3),  # NASA, 's, A/B, TEST (\w+ words: 4)
        ("I CANNOT, SIR", 4),  # I, CAN, NOT, SIR
    ],
)
def test_capital_words_are_counted_on_word_tokenize_words(text, capitals):
    assert sum(w.isupper() for w in word_tokens(text)) == capitals
    kwargs = {"capital_frequency": capitals, "capital_relation": "at least"}
    assert follows("change_case:capital_word_frequency", kwargs, text)
    assert not follows("change_case:capital_word_frequency", {**kwargs, "capital_relation": "less than"}, text)


@pytest.mark.parametrize(
    ("iid", "kwargs", "message"),
    [
        ("keywords:frequency", {"keyword": "x", "relation": "at least"}, "kwargs.frequency is missing"),
        ("keywords:frequency", {"keyword": "x", "frequency": 2, "relation": "at most"}, "kwargs.relation must be"),
        ("length_constraints:number_words", {"num_words": "5", "relation": "at least"}, "kwargs.num_words must be an"),
        ("keywords:existence", {"keywords": "river"}, "kwargs.keywords must be a non-empty list"),
        ("keywords:letter_frequency", {"letter": "ab", "let_frequency": 1, "let_relation": "at least"}, "one char"),
        ("detectable_content:postscript", {"postscript_marker": ""}, "kwargs.postscript_marker must be a non-empty"),
        (
            "length_constraints:nth_paragraph_first_word",
            {"num_paragraphs": 2, "nth_paragraph": 0, "first_word": "a"},
            "kwargs.nth_paragraph must be an integer >= 1",
        ),
    ],
)
def test_bad_kwargs_are_refused_by_field(iid, kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_kwargs(iid, kwargs)
