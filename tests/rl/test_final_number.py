"""final_number: the value a response or a dataset answer states, as MathJSONLTask compares
them (GSM8K's "####", MATH's last \\boxed{}, LaTeX fractions, exponents)."""

import pytest

from dualkv_compile.rl import final_number


@pytest.mark.parametrize("text,value", [
    ("The answer is .5", "1/2"), ("x = -.5", "-1/2"), ("Answer: \u22127", "-7"),
    ("The point is (1,5)", "5"), ("3/4", "3/4"), ("0.75", "3/4"), ("It is 10.00", "10"),
    ("1,234,567 apples", "1234567"), ("#### 42", "42"), ("so 12.", "12"), ("3/0 and 7", "7"),
    # MATH's LaTeX and the last \boxed{}; exponents; a hyphen after a digit is no minus (each
    # once read another number: 2, 4, 2, 3, -3, -5, -5)
    ("\\frac{1}{2}", "1/2"), ("so \\boxed{\\dfrac{3}{4}} since 4", "3/4"), ("3.14e2", "314"),
    ("5e3", "5000"), ("x = 1.5e-3", "3/2000"), ("10-5", "5"), ("on 2023-10-05", "5"),
    ("7, not 1e999999999", "7"),
    # signs before \frac, brace-free \frac12, mixed numbers and MATH's spacing in a box (each
    # once read another number: 3/4, 12, 1/2, 0), a unit kept out of it; a box that is not one
    # number is no number (each once read 2, 2, 3, 2)
    ("x = -\\frac{3}{4}", "-3/4"), ("\\boxed{\\frac12}", "1/2"),
    ("\\boxed{-1\\frac{1}{2}}", "-3/2"), ("\\boxed{10,\\!000}", "10000"),
    ("\\boxed{x = 5\\text{ cm}}", "5"), ("\\boxed{\\sqrt{2}}", None),
    ("\\boxed{2\\pi}", None), ("\\boxed{10^{3}}", None), ("\\boxed{(1,2)}", None),
    # a mixed number in running text is one value (each once read 1/2, 3/4, 1/2); a fraction
    # after a decimal, a list or a line break is not its fraction part
    ("The answer is 1 1/2.", "3/2"), ("so -2 3/4", "-11/4"), ("it is 1 \\frac{1}{2}", "3/2"),
    ("2.5 1/2", "1/2"), ("3 + 1/2", "1/2"), ("page 3\n1/2", "1/2"),
    # nor after a time, a ratio, a date, an exponent or a table's tab (each once read 61/2,
    # 3/2, 11/2, 5/2, 7/2 while mixed numbers were first read in running text)
    ("At 10:30 1/2 of them left", "1/2"), ("The ratio is 3:1 1/2", "1/2"),
    ("On 2023-10-05 1/2 were sold", "1/2"), ("x^2 1/2", "1/2"), ("x\ty\n3\t1/2", "1/2"),
])
def test_final_number_reads_values(text, value):
    # each of the first five once read another number: 5, 5, 7, 15, 4
    assert final_number(text) == value


@pytest.mark.parametrize("text,value", [
    # a box is the answer wherever "####" stands (a Markdown heading after it once discarded
    # the box: 41, None, 3); GSM8K's "#### 42" line wins over numbers after it (once 3)
    ("So \\boxed{42}.\n\n#### Verification\nIndeed 6 times 7 is 42, not 41.", "42"),
    ("So the answer is \\boxed{42}.\n\n#### Summary\nWe multiplied the factors.", "42"),
    ("\\boxed{42}\n##### Note: 3 checks passed", "42"),
    ("so 40 + 2\n#### 42\n\nNote: 3 checks", "42"),
    ("We get 42.\n#### Summary\nThat is all.", "42"),
    # a numbered heading is no answer line (a first '####' rule read 2, 2, 1, 6)
    ("#### Step 1: Find the cost\n7 each\n#### Step 2: Multiply\n3 * 14 = 42.\nThe answer is "
     "42.", "42"), ("#### Part 2\nSo she has 18 dollars.", "18"),
    ("### Solution\n#### 1. Compute\n5 + 7 = 12\nFinal answer: 12", "12"),
    ("#### 42\n#### Summary\nWe used 6 steps.", "42"), ("so\n####  $1,200.\nNote 3", "1200"),
    # units the docs name (each once None), an empty LaTeX argument (a TypeError)
    ("\\boxed{90°}", "90"), ("\\boxed{25\\text{ cm}^2}", "25"), ("\\boxed{5 \\text{ km}^2}", "5"),
    ("\\frac{}{2}", "2"), ("\\frac{ 3 }{ 4 }", "3/4"), ("x = 1e0005", "100000"),
    # past Python's 4300-digit limit for int() (each a ValueError that ended the run)
    ("x = 1e" + "0" * 4301 + "5", None), ("1" * 4301 + " 1/2", None),
    ("\\boxed{1 1/" + "7" * 4301 + "}", None),
    ("\\boxed{" + "9" * 4250 + " 1/" + "7" * 100 + "}", None),  # str() past the limit
    ("1 1/" + "9" * 5000, None),  # the 1 before a number past the limit was taken
    # LaTeX forms of a boxed number (each scored None, a right answer rewarded 0)
    ("\\boxed{1{,}000}", "1000"), ("\\boxed{+5}", "5"), ("\\boxed{\\text{5}}", "5"),
    ("\\boxed{\\textbf{5}}", "5"), ("\\boxed{\\mathbf{-5}}", "-5"), ("\\boxed{{5}}", "5"),
    ("\\boxed{{{3/4}}}", "3/4"), ("\\boxed{{1}{2}}", None),
    # a decimal comma is no thousands separator; \text{,} stays one; a word between numbers
    # makes no number (each once read as one: 125, 7125, 4500)
    ("\\boxed{0{,}125}", None), ("\\boxed{0,125}", None), ("\\boxed{1\\text{,}000}", "1000"),
    ("\\boxed{\\mathbf{7}\\text{ remainder }\\mathbf{125}}", None),
    ("\\boxed{\\text{4}\\text{ and }\\text{500}}", None), ("\\boxed{2 \\text{ or } 500}", None),
    ("\\boxed{" + "{" * 20_000 + "5" + "}" * 20_000 + "}", "5"),  # one pass, not quadratic
])
def test_final_number_edges(text, value):
    assert final_number(text) == value


@pytest.mark.parametrize("text,value", [
    # \boxed with a space, and a last box left open (a response cut off in it): the digits in
    # the box were read as the last number (2, 2, 3, 2, 2)
    ("\\boxed {\\sqrt{2}}", None), ("\\boxed {2\\pi}", None), ("\\boxed\t{10^{3}}", None),
    ("So \\boxed{\\sqrt{2}}. Again: \\boxed{\\sqrt{2", None),
    ("\\boxed{7}. Let me verify \\boxed{2\\pi", None), ("\\boxed {5}", "5"),
    # right answers once read as no number
    ("\\boxed{\\displaystyle 5}", "5"),
    ("\\boxed{5~\\text{cm}}", "5"), ("\\boxed{5\\textrm{ cm}}", "5"),
    ("\\boxed{\\frac{1}{-2}}", "-1/2"), ("-\\frac{1}{-2}", "1/2"),
    ("\\boxed{\\text{Area} = 25}", "25"), ("\\boxed{\\mathrm{3 i}}", None),
    # words after a number in one \text{} may change its value: none is read
    ("\\boxed{\\text{2 pi}}", None), ("\\boxed{\\text{1 million}}", None),
    # an en dash or a full-width minus is a sign (the wrong answer 5 was credited), not after
    # a digit (a range)
    ("The answer is \u20135", "-5"), ("The answer is \uff0d5", "-5"), ("pages 3\u20135", "5"),
    ("#### \u20137", "-7"),
    # spaced thousands in running text when a group after the first starts with 0 (each once
    # read 0, 0, 50); "1 500" may be two numbers and stays the last
    ("The answer is 1 000 000", "1000000"), ("so 12 000.", "12000"), ("-2 050 m", "-2050"),
    ("1 000 500", "1000500"), ("so 1 500", "500"),
    # a word before a box's number qualifies it unless it is a label (each once read 5)
    ("\\boxed{\\text{not } 5}", None), ("\\boxed{\\text{about }5}", None),
    ("\\boxed{\\text{Answer: } 5}", "5"), ("\\boxed{\\text{The answer is } 5}", "5"),
])
def test_final_number_boxes_units_and_signs(text, value):
    assert final_number(text) == value


def test_an_unclosed_fraction_takes_linear_time():
    # "\{\s*([^{}]*?)\s*\}" backtracked quadratically: 24 s at 4,000 spaces
    import time

    start = time.perf_counter()
    assert final_number("The answer is \\frac{" + " " * 20_000 + "x") is None
    assert final_number("\\boxed{\\frac{" + "\n" * 20_000 + "}") is None
    assert time.perf_counter() - start < 5.0  # about 0.01 s; the old pattern: minutes
