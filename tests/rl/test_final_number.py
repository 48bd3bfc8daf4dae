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
