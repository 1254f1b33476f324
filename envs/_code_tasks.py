"""The 20 tasks of ``code-tests-v0``, as literals: a description, visible tests (shown to the
model and run by its ``run_tests`` tool), hidden tests (the reward) and a reference solution
(never shown; the test-suite checks that it passes every test, which validates the literals).
"""

from __future__ import annotations

from dataclasses import dataclass

from agentrl.sandboxes import UnitTest as T


@dataclass(frozen=True)
class CodeTask:
    name: str
    """The function the model writes (also the task id suffix)."""
    signature: str
    description: str
    visible: tuple[T, ...]
    hidden: tuple[T, ...]
    reference: str


TASKS: tuple[CodeTask, ...] = (
    CodeTask(
        "digit_sum",
        "def digit_sum(n: int) -> int",
        "Return the sum of the decimal digits of the non-negative integer n.",
        (T("digit_sum(123)", 6), T("digit_sum(0)", 0)),
        (
            T("digit_sum(9)", 9),
            T("digit_sum(1001)", 2),
            T("digit_sum(99999)", 45),
            T("digit_sum(10**20)", 1),
            T("digit_sum(4096)", 19),
        ),
        "def digit_sum(n):\n    return sum(int(c) for c in str(n))\n",
    ),
    CodeTask(
        "is_palindrome",
        "def is_palindrome(s: str) -> bool",
        "Return True if s reads the same forwards and backwards, ignoring case and every "
        "character that is not a letter or a digit.",
        (T("is_palindrome('Racecar')", True), T("is_palindrome('hello')", False)),
        (
            T("is_palindrome('')", True),
            T("is_palindrome('A man, a plan, a canal: Panama')", True),
            T("is_palindrome('ab')", False),
            T("is_palindrome('No lemon, no melon')", True),
            T("is_palindrome('12321')", True),
            T("is_palindrome('123')", False),
        ),
        "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n"
        "    return t == t[::-1]\n",
    ),
    CodeTask(
        "fizzbuzz",
        "def fizzbuzz(n: int) -> list[str]",
        "Return the list of strings for 1..n: 'Fizz' for multiples of 3, 'Buzz' for multiples "
        "of 5, 'FizzBuzz' for multiples of both, otherwise the number itself as a string.",
        (T("fizzbuzz(5)", ["1", "2", "Fizz", "4", "Buzz"]),),
        (
            T("fizzbuzz(0)", []),
            T("fizzbuzz(1)", ["1"]),
            T("fizzbuzz(15)[-1]", "FizzBuzz"),
            T("fizzbuzz(15)[9:]", ["Buzz", "11", "Fizz", "13", "14", "FizzBuzz"]),
            T("len(fizzbuzz(100))", 100),
        ),
        "def fizzbuzz(n):\n    out = []\n    for i in range(1, n + 1):\n"
        "        s = ('Fizz' if i % 3 == 0 else '') + ('Buzz' if i % 5 == 0 else '')\n"
        "        out.append(s or str(i))\n    return out\n",
    ),
    CodeTask(
        "count_vowels",
        "def count_vowels(s: str) -> int",
        "Return how many vowels (a, e, i, o, u, in either case) s contains.",
        (T("count_vowels('hello')", 2), T("count_vowels('xyz')", 0)),
        (
            T("count_vowels('')", 0),
            T("count_vowels('AEIOU')", 5),
            T("count_vowels('Queueing')", 5),
            T("count_vowels('rhythm')", 0),
            T("count_vowels('a' * 1000)", 1000),
        ),
        "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
    ),
    CodeTask(
        "reverse_words",
        "def reverse_words(s: str) -> str",
        "Return the words of s in reverse order, separated by single spaces (words are "
        "separated by any whitespace; leading and trailing whitespace is dropped).",
        (T("reverse_words('hello world')", "world hello"),),
        (
            T("reverse_words('')", ""),
            T("reverse_words('one')", "one"),
            T("reverse_words('  a   b  c ')", "c b a"),
            T("reverse_words('x\\ty\\nz')", "z y x"),
        ),
        "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n",
    ),
    CodeTask(
        "is_prime",
        "def is_prime(n: int) -> bool",
        "Return True if the integer n is a prime number.",
        (T("is_prime(7)", True), T("is_prime(8)", False)),
        (
            T("is_prime(0)", False),
            T("is_prime(1)", False),
            T("is_prime(2)", True),
            T("is_prime(-7)", False),
            T("is_prime(7919)", True),
            T("is_prime(7917)", False),
            T("[n for n in range(30) if is_prime(n)]", [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]),
        ),
        "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n"
        "    while i * i <= n:\n        if n % i == 0:\n            return False\n        i += 1\n"
        "    return True\n",
    ),
    CodeTask(
        "fibonacci",
        "def fibonacci(n: int) -> int",
        "Return the n-th Fibonacci number, with fibonacci(0) == 0 and fibonacci(1) == 1.",
        (T("fibonacci(10)", 55), T("fibonacci(1)", 1)),
        (
            T("fibonacci(0)", 0),
            T("fibonacci(2)", 1),
            T("fibonacci(20)", 6765),
            T("fibonacci(90)", 2880067194370816120),
        ),
        "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
        "    return a\n",
    ),
    CodeTask(
        "gcd",
        "def gcd(a: int, b: int) -> int",
        "Return the greatest common divisor of two non-negative integers (gcd(0, 0) == 0).",
        (T("gcd(12, 18)", 6), T("gcd(7, 5)", 1)),
        (
            T("gcd(0, 5)", 5),
            T("gcd(5, 0)", 5),
            T("gcd(0, 0)", 0),
            T("gcd(1071, 462)", 21),
            T("gcd(2**40, 6**20)", 2**20),
        ),
        "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
    ),
    CodeTask(
        "flatten",
        "def flatten(items: list) -> list",
        "Return a flat list of the non-list elements of an arbitrarily nested list, in order.",
        (T("flatten([1, [2, 3], [[4]]])", [1, 2, 3, 4]),),
        (
            T("flatten([])", []),
            T("flatten([[], [[]]])", []),
            T("flatten([1, 2, 3])", [1, 2, 3]),
            T("flatten([['a', ['b']], 'c'])", ["a", "b", "c"]),
            T("flatten([1, [2, [3, [4, [5]]]]])", [1, 2, 3, 4, 5]),
        ),
        "def flatten(items):\n    out = []\n    for x in items:\n"
        "        out.extend(flatten(x) if isinstance(x, list) else [x])\n    return out\n",
    ),
    CodeTask(
        "run_length",
        "def run_length(s: str) -> str",
        "Run-length encode s: each maximal run of one character becomes the character "
        "followed by the run's length, e.g. 'aaabcc' -> 'a3b1c2'.",
        (T("run_length('aaabcc')", "a3b1c2"),),
        (
            T("run_length('')", ""),
            T("run_length('a')", "a1"),
            T("run_length('abab')", "a1b1a1b1"),
            T("run_length('zzzzzzzzzzzz')", "z12"),
        ),
        "def run_length(s):\n    out = []\n    i = 0\n    while i < len(s):\n        j = i\n"
        "        while j < len(s) and s[j] == s[i]:\n            j += 1\n"
        "        out.append(f'{s[i]}{j - i}')\n        i = j\n    return ''.join(out)\n",
    ),
    CodeTask(
        "two_sum",
        "def two_sum(nums: list[int], target: int) -> list[int] | None",
        "Return [i, j] with i < j and nums[i] + nums[j] == target, choosing the smallest j and "
        "then the smallest i; return None if there is no such pair.",
        (T("two_sum([2, 7, 11, 15], 9)", [0, 1]),),
        (
            T("two_sum([3, 2, 4], 6)", [1, 2]),
            T("two_sum([1, 2], 7)", None),
            T("two_sum([3, 3], 6)", [0, 1]),
            T("two_sum([], 0)", None),
            T("two_sum([1, 5, 1, 5], 10)", [1, 3]),
        ),
        "def two_sum(nums, target):\n    for j in range(len(nums)):\n        for i in range(j):\n"
        "            if nums[i] + nums[j] == target:\n                return [i, j]\n"
        "    return None\n",
    ),
    CodeTask(
        "max_subarray",
        "def max_subarray(nums: list[int]) -> int",
        "Return the largest sum of a non-empty contiguous subarray of the non-empty list nums.",
        (T("max_subarray([-2, 1, -3, 4, -1, 2, 1, -5, 4])", 6),),
        (
            T("max_subarray([1])", 1),
            T("max_subarray([-3, -1, -2])", -1),
            T("max_subarray([5, 4, -1, 7, 8])", 23),
            T("max_subarray([0, 0, 0])", 0),
        ),
        "def max_subarray(nums):\n    best = cur = nums[0]\n    for x in nums[1:]:\n"
        "        cur = max(x, cur + x)\n        best = max(best, cur)\n    return best\n",
    ),
    CodeTask(
        "is_anagram",
        "def is_anagram(a: str, b: str) -> bool",
        "Return True if a and b contain the same letters the same number of times, ignoring "
        "case and spaces.",
        (T("is_anagram('listen', 'silent')", True), T("is_anagram('abc', 'abd')", False)),
        (
            T("is_anagram('', '')", True),
            T("is_anagram('Dormitory', 'dirty room')", True),
            T("is_anagram('aab', 'abb')", False),
            T("is_anagram('a', 'aa')", False),
        ),
        "def is_anagram(a, b):\n    f = lambda s: sorted(s.replace(' ', '').lower())\n"
        "    return f(a) == f(b)\n",
    ),
    CodeTask(
        "roman_to_int",
        "def roman_to_int(s: str) -> int",
        "Convert a valid Roman numeral (I, V, X, L, C, D, M with subtractive pairs) to an int.",
        (T("roman_to_int('III')", 3), T("roman_to_int('IX')", 9)),
        (
            T("roman_to_int('LVIII')", 58),
            T("roman_to_int('MCMXCIV')", 1994),
            T("roman_to_int('MMMCMXCIX')", 3999),
            T("roman_to_int('XL')", 40),
        ),
        "def roman_to_int(s):\n    v = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500,"
        " 'M': 1000}\n    total = 0\n    for i, c in enumerate(s):\n"
        "        if i + 1 < len(s) and v[c] < v[s[i + 1]]:\n            total -= v[c]\n"
        "        else:\n            total += v[c]\n    return total\n",
    ),
    CodeTask(
        "to_binary",
        "def to_binary(n: int) -> str",
        "Return the binary representation of the non-negative integer n, without a prefix.",
        (T("to_binary(5)", "101"), T("to_binary(0)", "0")),
        (
            T("to_binary(1)", "1"),
            T("to_binary(2)", "10"),
            T("to_binary(255)", "11111111"),
            T("to_binary(1024)", "10000000000"),
        ),
        "def to_binary(n):\n    return format(n, 'b')\n",
    ),
    CodeTask(
        "second_largest",
        "def second_largest(nums: list[int]) -> int | None",
        "Return the second largest distinct value in nums, or None if there is none.",
        (T("second_largest([3, 1, 4, 1, 5])", 4),),
        (
            T("second_largest([])", None),
            T("second_largest([7])", None),
            T("second_largest([2, 2, 2])", None),
            T("second_largest([-1, -5, -3])", -3),
            T("second_largest([5, 5, 4])", 4),
            T("second_largest([10, 20])", 10),
            T("second_largest([1, 2, 3, 4])", 3),
        ),
        "def second_largest(nums):\n    s = sorted(set(nums))\n"
        "    return s[-2] if len(s) >= 2 else None\n",
    ),
    CodeTask(
        "word_count",
        "def word_count(s: str) -> dict[str, int]",
        "Return a dict mapping each lower-cased whitespace-separated word of s to its count.",
        (T("word_count('a b a')", {"a": 2, "b": 1}),),
        (
            T("word_count('')", {}),
            T("word_count('The the THE')", {"the": 3}),
            T("word_count(' x\\ny  x ')", {"x": 2, "y": 1}),
            T("word_count('Hi hi, hi')", {"hi": 2, "hi,": 1}),
        ),
        "def word_count(s):\n    out = {}\n    for w in s.lower().split():\n"
        "        out[w] = out.get(w, 0) + 1\n    return out\n",
    ),
    CodeTask(
        "balanced",
        "def balanced(s: str) -> bool",
        "Return True if the brackets (), [] and {} in s are balanced and properly nested "
        "(other characters are ignored).",
        (T("balanced('([]{})')", True), T("balanced('(]')", False)),
        (
            T("balanced('')", True),
            T("balanced('((')", False),
            T("balanced('))((')", False),
            T("balanced('a(b[c]{d}e)f')", True),
            T("balanced('([)]')", False),
            T("balanced('{[()()]}')", True),
        ),
        "def balanced(s):\n    pairs = {')': '(', ']': '[', '}': '{'}\n    stack = []\n"
        "    for c in s:\n        if c in '([{':\n            stack.append(c)\n"
        "        elif c in pairs:\n            if not stack or stack.pop() != pairs[c]:\n"
        "                return False\n    return not stack\n",
    ),
    CodeTask(
        "merge_sorted",
        "def merge_sorted(a: list[int], b: list[int]) -> list[int]",
        "Merge two sorted lists into one sorted list.",
        (T("merge_sorted([1, 3], [2, 4])", [1, 2, 3, 4]),),
        (
            T("merge_sorted([], [])", []),
            T("merge_sorted([1], [])", [1]),
            T("merge_sorted([], [0, 0])", [0, 0]),
            T("merge_sorted([1, 1, 5], [1, 2])", [1, 1, 1, 2, 5]),
            T("merge_sorted([-3, 10], [-5, 0, 20])", [-5, -3, 0, 10, 20]),
        ),
        "def merge_sorted(a, b):\n    return sorted(a + b)\n",
    ),
    CodeTask(
        "chunk",
        "def chunk(items: list, size: int) -> list[list]",
        "Split items into consecutive lists of length size (the last may be shorter). Raise "
        "ValueError if size < 1.",
        (T("chunk([1, 2, 3, 4, 5], 2)", [[1, 2], [3, 4], [5]]),),
        (
            T("chunk([], 3)", []),
            T("chunk([1, 2], 5)", [[1, 2]]),
            T("chunk([1, 2, 3], 1)", [[1], [2], [3]]),
            T("chunk([1], 0)", raises="ValueError"),
            T("chunk([1], -2)", raises="ValueError"),
        ),
        "def chunk(items, size):\n    if size < 1:\n        raise ValueError('size must be >= 1')\n"
        "    return [items[i:i + size] for i in range(0, len(items), size)]\n",
    ),
    CodeTask(
        "celsius_to_fahrenheit",
        "def celsius_to_fahrenheit(c: float) -> float",
        "Convert a temperature from degrees Celsius to degrees Fahrenheit.",
        (T("celsius_to_fahrenheit(100)", 212.0, float_tol=1e-9),),
        (
            T("celsius_to_fahrenheit(0)", 32.0, float_tol=1e-9),
            T("celsius_to_fahrenheit(-40)", -40.0, float_tol=1e-9),
            T("celsius_to_fahrenheit(36.6)", 97.88, float_tol=1e-9),
            T("celsius_to_fahrenheit(-273.15)", -459.67, float_tol=1e-9),
        ),
        "def celsius_to_fahrenheit(c):\n    return c * 9 / 5 + 32\n",
    ),
)
