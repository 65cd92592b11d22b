"""The bounded jinja2 sandbox chat templates render in (moe.engine.chat_template is the API over
it). A template can come with a request, so its render is bounded in whatever process runs it: the
sandbox checks a budget as it goes, a deadline at every loop step, call, filter, attribute lookup
and operator (and while lexing, parsing and compiling), and the size of what it builds before
building it (`'x' * n`, `+`, `~`, `%`, format widths, join, replace, indent, integers of more than
64 Kibit, the output). Deep recursion is a RecursionError, caught. `render_here` turns every way a
template can fail into a ValueError naming the problem. What transformers gives templates is there too:
`tojson`, `raise_exception`, `strftime_now`, the `{% generation %}` tag, and tool calls' arguments as
moe.engine.tool_arguments reads them.

TemplateLimits, and the environment variables that set them, live here because the budget's
messages name them; chat_template.py re-exports them and reads the variables.
"""
from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from dataclasses import dataclass
from functools import lru_cache

from moe.engine.tool_arguments import with_tool_arguments

TIMEOUT_ENV = "MOE_CHAT_TEMPLATE_TIMEOUT_S"
MAX_OUTPUT_ENV = "MOE_CHAT_TEMPLATE_MAX_OUTPUT_CHARS"
MAX_SOURCE_ENV = "MOE_CHAT_TEMPLATE_MAX_SOURCE_CHARS"

_MAX_INT_BITS = 1 << 16  # integers a template builds with * and **


@dataclass(frozen=True)
class TemplateLimits:
    timeout_s: float = 5.0
    max_output_chars: int = 4 << 20
    max_source_chars: int = 128 << 10

    def __post_init__(self) -> None:
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ValueError(f"chat template timeout_s must be a positive number, got {self.timeout_s!r}")
        for name in ("max_output_chars", "max_source_chars"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"chat template {name} must be a positive integer, got {value!r}")


class TemplateBudgetError(Exception):
    """Over the time or size budget. Not a ValueError / TypeError / LookupError: jinja's filters
    and lookups catch those, and a template must not be able to swallow this."""


class _Budget:
    __slots__ = ("limits", "deadline")

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout_s

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBudgetError(f"took longer than {self.limits.timeout_s:g} s to render (the limit, "
                                      f"{TIMEOUT_ENV})")

    def size(self, n: int, what: str, how: str = "", unit: str = "characters") -> None:
        """what, of n units, built how: within the output limit."""
        if n > self.limits.max_output_chars:
            raise TemplateBudgetError(f"would build {what} of {n} {unit}{' ' + how if how else ''}, more than the "
                                      f"limit of {self.limits.max_output_chars} ({MAX_OUTPUT_ENV})")

    def width(self, values, what: str) -> None:
        """Integer arguments that size an output (widths, counts) within the output limit."""
        for v in values:
            if _is_int(v) and abs(v) > self.limits.max_output_chars:
                raise TemplateBudgetError(f"asks for {what} of {v}, more than the output limit of "
                                          f"{self.limits.max_output_chars} ({MAX_OUTPUT_ENV})")

    def int_bits(self, bits: int) -> None:
        if bits > _MAX_INT_BITS:
            raise TemplateBudgetError(f"would build an integer of about {bits} bits, more than the limit of "
                                      f"{_MAX_INT_BITS}")


# The budget of the render running in this thread (each render sets its own, so that renders in
# several threads share a compiled template but not a budget).
_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("chat_template_budget", default=None)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _deep_size(value, limit: int) -> int:
    """About how many characters str(value) takes: string lengths plus one per other item, through
    nested lists, tuples and dicts (a list holding one big list a million times counts a million
    times), counted until past `limit`."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) + 1
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += len(v) + 1
            stack.extend(v)
        elif isinstance(v, dict):
            total += 2 * len(v) + 1
            stack.extend(v.keys())
            stack.extend(v.values())
        else:
            total += 1
    return total


def _check_container(budget: _Budget, value, what: str, how: str = "") -> None:
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        budget.size(_deep_size(value, budget.limits.max_output_chars), what, how)


# %-format conversions: their widths and precisions (a '*' takes them from the arguments).
_PERCENT_SPEC_RE = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")


def _check_percent(budget: _Budget, fmt: str, args) -> None:
    for spec in _PERCENT_SPEC_RE.finditer(fmt):
        budget.width((int(n) for n in spec.groups() if n and n != "*"), "a %-format width")
    values = args if isinstance(args, tuple) else (args,)
    budget.width(values, "a %-format width")
    budget.size(len(fmt) + sum(_deep_size(v, budget.limits.max_output_chars) for v in values), "a string", "with %")


def _check_str_format(budget: _Budget, fmt: str, args, kwargs) -> None:
    import string

    try:
        specs = [spec for _, _, spec, _ in string.Formatter().parse(fmt) if spec]
    except ValueError:
        return  # str.format raises it again, with its own message
    for spec in specs:
        budget.width((int(n) for n in re.findall(r"\d+", spec)), "a str.format width")
    budget.width([*args, *kwargs.values()], "a str.format width")


def _check_binop(budget: _Budget, operator: str, left, right) -> None:
    limit = budget.limits.max_output_chars
    if operator == "*":
        if _is_int(left) and _is_int(right):
            budget.int_bits(left.bit_length() + right.bit_length())
            return
        seq, n = (left, right) if _is_int(right) else (right, left)
        if _is_int(n) and n > 0 and isinstance(seq, (str, list, tuple)):
            if isinstance(seq, str):
                budget.size(len(seq) * n, "a string", "with *")
            else:
                budget.size(_deep_size(seq, limit // n + 1) * n, "a list", "with *", "items")
    elif operator == "**":
        if _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
            budget.int_bits((abs(left).bit_length() - 1) * right)
    elif operator == "+":
        if isinstance(left, str) and isinstance(right, str):
            budget.size(len(left) + len(right), "a string", "with +")
        elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
            budget.size(_deep_size(left, limit) + _deep_size(right, limit), "a list", "with +", "items")
    elif operator == "%" and isinstance(left, str):
        _check_percent(budget, left, right)


_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})


def _check_str_method(budget: _Budget, owner: str, name: str, args: tuple, kwargs: dict) -> tuple:
    """Checks before calling a str method; the arguments to call it with (join's iterable as a list)."""
    if name in _WIDTH_METHODS:
        budget.width([*args, *kwargs.values()], f"a str.{name}() width")
    elif name == "format":
        _check_str_format(budget, owner, args, kwargs)
    elif name == "format_map" and args and isinstance(args[0], dict):
        _check_str_format(budget, owner, (), args[0])
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _check_replace(budget, owner, *args[:3])
    elif name == "join" and args:
        items = list(args[0])
        budget.size(sum(len(x) if isinstance(x, str) else 1 for x in items) + len(owner) * max(len(items) - 1, 0),
                    "a string", "with join")
        return (items, *args[1:])
    return args


def _check_replace(budget: _Budget, s: str, old: str, new: str, count=-1) -> None:
    if len(new) > len(old):
        times = s.count(old) if old else len(s) + 1
        if _is_int(count) and count >= 0:
            times = min(times, count)
        budget.size(len(s) + times * (len(new) - len(old)), "a string", "with replace")


# Filters whose integer arguments size their output (widths, counts).
_WIDTH_FILTERS = frozenset({"center", "indent", "wordwrap", "truncate", "batch", "slice", "tojson"})
# Filters that turn their value into a string (a nested list becomes its repr).
_STRINGIFYING_FILTERS = frozenset({
    "string", "tojson", "pprint", "e", "escape", "forceescape", "safe", "upper", "lower", "title", "capitalize",
    "trim", "center", "wordwrap", "truncate", "striptags", "urlize", "urlencode", "wordcount", "xmlattr", "indent",
    "replace", "format"})


def _check_filter(budget: _Budget, name: str, args: tuple, kwargs: dict, first: int) -> tuple:
    """Checks before calling filter `name`; args[first] is the filtered value. Returns the
    arguments to call it with (join's iterable as a list)."""
    if len(args) <= first:
        return args
    value, rest = args[first], args[first + 1:]
    if name in _WIDTH_FILTERS:
        budget.width([*rest, *kwargs.values()], f"a {name} filter width")
    if name in _STRINGIFYING_FILTERS:
        _check_container(budget, value, "the text of a value", f"for the {name} filter")
    if name == "join":
        items = list(value)
        sep = rest[0] if rest else kwargs.get("d", "")
        lengths = sum(len(x) if isinstance(x, str) else _deep_size(x, budget.limits.max_output_chars) for x in items)
        budget.size(lengths + len(str(sep)) * max(len(items) - 1, 0), "a string", "with the join filter")
        return (*args[:first], items, *rest)
    if name == "replace" and isinstance(value, str) and len(rest) >= 2:
        _check_replace(budget, value, str(rest[0]), str(rest[1]), *rest[2:3])
    elif name == "indent" and isinstance(value, str):
        width = rest[0] if rest else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else width if _is_int(width) else 0
        budget.size(len(value) + width * (value.count("\n") + 1), "a string", "with the indent filter")
    elif name == "format" and isinstance(value, str):
        _check_percent(budget, value, tuple(rest) or tuple(kwargs.values()))
    elif name == "tojson":
        indent = kwargs.get("indent", rest[1] if len(rest) > 1 else None)
        width = len(indent) if isinstance(indent, str) else indent if _is_int(indent) else 0
        budget.size(_deep_size(value, budget.limits.max_output_chars) * (1 + width), "JSON", "with the tojson filter")
    elif name == "sum":
        start = kwargs.get("start", rest[1] if len(rest) > 1 else 0)
        if not isinstance(start, (int, float)):  # sum(start=[]) concatenates lists in quadratic time
            raise TemplateBudgetError("uses the sum filter with a start that is not a number: it adds numbers only")
    return args


def _check_result(budget: _Budget, result) -> None:
    if isinstance(result, (str, list, tuple, dict)):
        budget.size(len(result), "a value")


def _bounded_filter(name: str, func):
    from jinja2.utils import _PassArg

    first = 0 if _PassArg.from_obj(func) is None else 1  # pass_context & co: the value comes second

    def bounded(*args, **kwargs):
        budget = _budget.get()
        if budget is not None:
            budget.tick()
            args = _check_filter(budget, name, args, kwargs, first)
        result = func(*args, **kwargs)
        if budget is not None:
            _check_result(budget, result)
        return result

    return functools.update_wrapper(bounded, func)  # keeps jinja_pass_arg


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt):
    """transformers' `strftime_now` (Llama templates print today's date with it)."""
    import datetime

    return datetime.datetime.now().strftime(str(fmt))


_BOUNDED_ITER = "_moe_bounded_iter"


def _bounded_iter(context, iterable):
    budget = _budget.get()
    for item in iterable:
        if budget is not None:
            budget.tick()
        yield item


def _finalize(value):
    """What `{{ ... }}` prints: a nested list or dict is sized before str() builds its text."""
    budget = _budget.get()
    if budget is not None:
        _check_container(budget, value, "the text of a printed value")
    return value


@lru_cache(maxsize=1)
def _sandbox_classes():
    """The bounded environment's classes (made on first use: jinja2 loads only when a template renders)."""
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCodeGenerator(CodeGenerator):
        def visit(self, node, *args, **kwargs):  # compiling is within the deadline too
            budget = _budget.get()
            if budget is not None:
                budget.tick()
            return super().visit(node, *args, **kwargs)

        def visit_Template(self, node, frame=None):
            # Every `for` iterates through _BOUNDED_ITER, a deadline check per step (jinja2 allows
            # no node types of one's own, so it is an internal filter).
            for loop in list(node.find_all(nodes.For)):
                loop.iter = nodes.Filter(loop.iter, _BOUNDED_ITER, [], [], None, None, lineno=loop.iter.lineno)
                loop.iter.set_environment(self.environment)
            return super().visit_Template(node, frame)

        def visit_Concat(self, node, frame):  # `~`: sized before it is joined
            if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
                return super().visit_Concat(node, frame)
            self.write("environment.str_join((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class GenerationTag(Extension):
        """transformers' `{% generation %}...{% endgeneration %}` (it marks the assistant's tokens for
        training masks): the body renders as it is."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    class LexDeadline(Extension):
        """Lexing and parsing are within the deadline: one check per token."""

        def filter_stream(self, stream):
            budget = _budget.get()
            for token in stream:
                if budget is not None:
                    budget.tick()
                yield token

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%", "+"})
        code_generator_class = BoundedCodeGenerator

        def call_binop(self, context, operator, left, right):
            budget = _budget.get()
            if budget is not None:
                budget.tick()
                _check_binop(budget, operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # jinja2's names: no clash with kwargs
            budget = _budget.get()
            if budget is not None:
                budget.tick()
                target = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
                owner = getattr(target, "__self__", None)
                if isinstance(owner, str):
                    args = _check_str_method(budget, owner, getattr(target, "__name__", ""), args, kwargs)
            result = super().call(__context, __obj, *args, **kwargs)
            if budget is not None:
                _check_result(budget, result)
            return result

        def getattr(self, obj, attribute):
            budget = _budget.get()
            if budget is not None:
                budget.tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            budget = _budget.get()
            if budget is not None:
                budget.tick()
            return super().getitem(obj, argument)

        def concat(self, parts):  # the output, and the bodies of macros, blocks and {% set %}...{% endset %}
            budget = _budget.get()
            if budget is None:
                return "".join(parts)
            out, total = [], 0
            for part in parts:
                total += len(part)
                budget.size(total, "output")
                out.append(part)
            return "".join(out)

        def str_join(self, parts):
            budget = _budget.get()
            out, total = [], 0
            for part in parts:
                if budget is not None:
                    _check_container(budget, part, "the text of a value", "for ~")
                part = str(part)
                total += len(part)
                if budget is not None:
                    budget.size(total, "a string", "with ~")
                out.append(part)
            return "".join(out)

    return BoundedEnvironment, LexDeadline, GenerationTag


@lru_cache(maxsize=8)
def _compile(source: str):
    """The compiled template (cached by source); a ValueError naming what is wrong with it."""
    from jinja2 import nodes, pass_context
    from jinja2.exceptions import TemplateSyntaxError

    environment_class, lex_deadline, generation_tag = _sandbox_classes()
    env = environment_class(trim_blocks=True, lstrip_blocks=True, finalize=_finalize,
                            extensions=["jinja2.ext.loopcontrols", lex_deadline, generation_tag])
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters[_BOUNDED_ITER] = pass_context(_bounded_iter)  # pass_context: never run at compile time
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals.pop("lipsum", None)  # lipsum(n) writes n paragraphs in one call: nothing a chat template needs
    try:
        tree = env.parse(source)
    except TemplateSyntaxError as e:
        raise ValueError(f"the chat template has a syntax error at line {e.lineno}: {e.message}") from None
    except RecursionError:
        raise ValueError("the chat template nests too deeply to parse") from None
    for kind, tag in ((nodes.Extends, "extends"), (nodes.Include, "include"), (nodes.Import, "import"),
                      (nodes.FromImport, "from ... import")):
        node = tree.find(kind)
        if node is not None:
            raise ValueError(f"the chat template uses {{% {tag} %}} (line {node.lineno}): a chat template must be "
                             "self-contained, there are no other templates to load")
    try:
        return env.from_string(tree)
    except TemplateSyntaxError as e:  # an unknown filter or test, a misused loop variable, ...
        raise ValueError(f"the chat template is invalid at line {e.lineno}: {e.message}") from None
    except (RecursionError, SyntaxError, MemoryError):  # Python's compiler on the generated code
        raise ValueError("the chat template nests too deeply to compile") from None


def render_here(source: str, context: dict, limits: TemplateLimits) -> str:
    """Compile (cached) and render in this thread, within the budget; any failure a ValueError."""
    from jinja2.exceptions import TemplateError

    token = _budget.set(_Budget(limits))
    try:
        return _compile(source).render(**with_tool_arguments(context))
    except TemplateBudgetError as e:
        raise ValueError(f"the chat template {e}") from None
    except RecursionError:
        raise ValueError("the chat template recursed too deeply (a macro or recursive loop without end?)") from None
    except MemoryError:
        raise ValueError("the chat template ran out of memory while rendering") from None
    except TemplateError as e:  # raise_exception, undefined values, sandbox refusals
        raise ValueError(f"the chat template failed on these messages: {short_error(e)}") from None
    except ValueError:
        raise
    except Exception as e:  # range too big, 1/0, a type error in an expression, ...
        raise ValueError(f"the chat template failed on these messages ({type(e).__name__}: "
                         f"{short_error(e)})") from None
    finally:
        _budget.reset(token)


def short_error(e: BaseException, limit: int = 500) -> str:
    text = str(e)
    return text if len(text) <= limit else text[:limit - 3] + "..."
