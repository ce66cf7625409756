"""What every operator shares: its definition, the plan that runs it, and layout helpers.

An operator is a `build` function that turns a `Problem` into a *pipeline*
``(xs, ctx, extra) -> result``: pure code over the backend's primitives, which
the backend may compile as a whole when the operator is prepared.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import difflib

import attrs

from .. import _arrays as arrays
from .._annotations import Annotation
from .._errors import UnsupportedError, drop_jax_note, short_repr
from .._problem import HAS_AUX, Arguments, Problem, Traced, a, describe_type, float_advice, parse_call
from .._tree import flatten, leaf_paths
from ..backends import Backend, placeholders_are_allowed, resolve_backend
from ..backends._base import SignatureChanged, stack_batch


@attrs.frozen
class Operator:
    """One operator: its name, what its pipeline needs, and how to build the pipeline."""

    name: str
    build: Callable[..., Callable[..., Any]]  # build(problem, f, backend, seeds, **options) -> pipeline
    seed: str | None = None  # "tangent" or "cotangent": the per-call vector the operator takes
    scalar_input: bool = False


@attrs.frozen
class Seeds:
    """The tangents or cotangents of one call: flat leaves, whether batched, and the static part."""

    leaves: tuple[Any, ...]
    batch: int | None  # None for a single tangent; the batch size for `tangents=[...]`
    spec: Any = None  # cotangents: the output structure they were given in

    @property
    def key(self) -> tuple[Any, ...]:
        return (self.batch, self.spec)


REGISTRY: dict[str, Operator] = {}


def operator_options(operator: Operator) -> tuple[str, ...]:
    """The operator's own keywords: never an argument for f."""
    seeds = () if operator.seed is None else (operator.seed, operator.seed + "s")
    return ("backend", *(("has_aux",) if operator.name in HAS_AUX else ()), *seeds)


def refuse_annotated_options(operator: Operator, given: dict[str, Any], caller: str | None = None) -> None:
    """An annotation passed as one of the operator's own options (``backend=Constant(x)``) is a
    keyword argument for f that clashes with the option: a TypeError that says so."""
    for name, value in given.items():
        if isinstance(value, Annotation):
            where = f"activity.prepare(activity.{operator.name}, ...)" if caller else f"activity.{operator.name}"
            raise TypeError(
                f"{where}: {name}= is an option of the operator, but it got {type(value).__name__}(...), an "
                f"annotated argument for f. A keyword argument of f cannot be named {name} (the operator's "
                f"options are {', '.join(o + '=' for o in operator_options(operator))}): rename it in f, or "
                f"pass it positionally."
            )


_JAX_HABITS = {
    "argnums": (
        "activity has no argnums=: the annotations say what is differentiated. Wrap the argument to "
        "differentiate in Active(...) and the others in Constant(...): activity.{op}(f, Active(x), Constant(y))."
    ),
    "holomorphic": (
        "activity has no holomorphic=: a complex Active is refused on every backend (complex derivatives "
        "have more than one convention). Drop holomorphic= and pass the real and imaginary parts as two real "
        "Active arrays, f rebuilding z = re + 1j * im."
    ),
    "allow_int": (
        "activity has no allow_int=: integer leaves of an Active pass through unchanged and get None in "
        "the result. Drop allow_int=, or pass integer data as Constant(...)."
    ),
}
"""Options of ``jax.grad`` (and ``jax.jacobian``, ``jax.hessian``) that activity does without:
what to do instead, for a user who writes them out of habit."""


def unannotated_keyword_message(
    operator: Operator, name: str, value: Any, options: Sequence[str], caller: str | None = None
) -> str:
    """Why ``name=value`` is refused: not an annotation, so not for f, and not an option either."""
    habit = _JAX_HABITS.get(name)
    if habit is not None:
        return (
            f"activity.{operator.name} got the keyword argument {name}={short_repr(value)}, a jax.grad option. "
            f"{habit.format(op=operator.name)} The options{' of activity.prepare' if caller else ''} here are "
            f"{', '.join(o + '=' for o in options)}."
        )
    close = difflib.get_close_matches(name, options, n=1)
    hint = f"Did you mean {close[0]}=? " if close else ""
    others = {o: op.name for op in REGISTRY.values() for o in operator_options(op) if o not in options}
    if not close and name in others:
        hint = f"{name}= is an option of other operators (such as activity.{others[name]}), not of this one. "
    elif not close and (close := difflib.get_close_matches(name, list(others), n=1)):
        hint = f"Did you mean {close[0]}=? (an option of other operators, such as activity.{others[close[0]]}) "
    return (
        f"activity.{operator.name} got unexpected keyword argument(s) [{name!r}] ({describe_type(value)}), which "
        f"is not annotated, so it is not an argument for f either. {hint}A keyword argument for f is annotated: "
        f"Active(x) to differentiate it, Constant(x) for data, or Cache(x) for scratch space f may overwrite. "
        f"The options{' of activity.prepare' if caller else ''} here are {', '.join(o + '=' for o in options)}."
    )


def check_keywords(operator: Operator, keywords: dict[str, Any]) -> None:
    """Every keyword argument for f is annotated; a raw one gets the closest option as a hint."""
    for name, value in keywords.items():
        if not isinstance(value, Annotation) or type(value) is Annotation:
            raise TypeError(unannotated_keyword_message(operator, name, value, operator_options(operator)))


def operator_of(op: Any) -> Operator:
    """The `Operator` behind a public operator function or its name."""
    name = op if isinstance(op, str) else getattr(op, "__activity_operator__", None)
    if name not in REGISTRY:
        raise TypeError(
            f"{op!r} is not an activity operator. Pass one of the operator functions "
            f"(e.g. activity.gradient) or its name; known: {', '.join(sorted(REGISTRY))}."
        )
    return REGISTRY[name]


def register(operator: Operator, function: Callable[..., Any]) -> Callable[..., Any]:
    REGISTRY[operator.name] = operator
    function.__activity_operator__ = operator.name  # type: ignore[attr-defined]
    return function


def encode_seeds(operator: Operator, problem: Problem, kwargs: dict[str, Any]) -> Seeds | None:
    """Check and flatten ``tangent=``/``tangents=`` (or cotangents) for ``operator``."""
    if operator.seed is None:
        if kwargs:
            raise TypeError(f"activity.{operator.name} got unexpected keyword argument(s) {sorted(kwargs)}.")
        return None
    one, many = operator.seed, operator.seed + "s"
    unexpected = set(kwargs) - {one, many}
    if unexpected:
        raise TypeError(f"activity.{operator.name} got unexpected keyword argument(s) {sorted(unexpected)}.")
    single: Any
    batch: Any
    single, batch = kwargs.get(one), kwargs.get(many)
    if (single is None) == (batch is None):
        raise TypeError(
            f"activity.{operator.name} needs exactly one of {one}= (one vector) or {many}= (a list of them); "
            f"got {'both' if single is not None else 'neither'}."
        )
    encode: Callable[[Any, str], tuple[tuple[Any, ...], Any]]
    if one == "tangent":
        encode = lambda tree, what: (problem.flat_like_active(tree, what), None)  # noqa: E731
    else:
        encode = lambda tree, what: _encode_cotangent(tree, what, operator.name)  # noqa: E731
    if single is not None:
        try:
            leaves, spec = encode(single, one)
        except ValueError as error:
            if one != "tangent" or not isinstance(single, list) or _list_like_active(problem, single):
                raise
            raise ValueError(f"{error}{batch_hint(one, len(single))}") from None
        return Seeds(leaves, None, spec)
    if not isinstance(batch, (list, tuple)) or len(batch) == 0:
        raise ValueError(
            f"activity.{operator.name}: {many}= must be a non-empty list of {one}s, got "
            f"{describe_type(batch)} of length {len(batch) if hasattr(batch, '__len__') else '?'}."
        )
    encoded = [encode(item, f"{many}[{b}]") for b, item in enumerate(batch)]
    specs = {spec for _, spec in encoded if spec is not None}
    if len(specs) > 1:
        raise ValueError(f"activity.{operator.name}: all {many} must have the same structure.")
    return Seeds(stack_batch([leaves for leaves, _ in encoded]), len(batch), encoded[0][1])


def batch_hint(seed: str, length: int) -> str:
    """For a list given as one tangent (or cotangent) where its structure is not a list: it is
    likely a batch, as ``jax.vmap`` users write one, which is ``tangents=`` here."""
    return (
        f" If this list of {length} is a batch of {seed}s (one result for each), pass it as "
        f"{seed}s=[...] instead of {seed}=."
    )


def _list_like_active(problem: Problem, tangent: list[Any]) -> bool:
    """Whether a list tangent has the structure of the Active arguments at its root: a list-valued
    Active's tangent is a list, and several Actives' tangents are one entry each."""
    if len(problem.active_positions) > 1:
        return len(tangent) == len(problem.active_positions)
    position = problem.active_positions[0]
    spec = problem.adapted[position][3] if position in problem.adapted else problem.specs[position]
    return spec.type is list and spec.num_children == len(tangent)


def _encode_cotangent(tree: Any, what: str, op_name: str) -> tuple[tuple[Any, ...], Any]:
    leaves, spec = flatten(tree)
    for index, leaf in enumerate(leaves):
        if not (arrays.is_array(leaf) or isinstance(leaf, float)) or arrays.dtype_kind(leaf) != "f":
            path = leaf_paths(tree)[index]
            dtype = f" of dtype {leaf.dtype}" if hasattr(leaf, "dtype") else ""
            advice = float_advice(leaf)
            raise ValueError(
                f"activity.{op_name}: {what}{path} is {describe_type(leaf)}{dtype}; a cotangent holds float "
                f"arrays shaped like f's output" + (f": {advice}." if advice else ".")
            )
    return tuple(leaves), spec


class Plan:
    """Everything one-time for an operator on one call signature: checks, problem, pipeline."""

    operator: Operator
    backend: Backend
    f: Callable[..., Any]
    options: dict[str, Any]
    problem: Problem
    seeds: Seeds | None
    seed_key: tuple[Any, ...] | None
    pipeline: Callable[..., Any]  # compiled by the backend once prepared
    source_pipeline: Callable[..., Any]

    def __init__(
        self,
        operator: Operator,
        f: Callable[..., Any],
        kinds: tuple[str, ...],
        values: tuple[Any, ...],
        backend: Backend | None,
        options: dict[str, Any],
        seed_kwargs: dict[str, Any],
        mode: str = "unprepared",
        *,
        wheres: tuple[Any, ...] | None = None,
        keywords: tuple[str, ...] = (),
    ):
        backend = resolve_backend(operator.name, backend, values)
        for kind in dict.fromkeys(kinds):
            if not backend.supports(operator.name, kind, mode):
                raise UnsupportedError(
                    f"{backend!r} does not support activity.{operator.name} with {a(kind.capitalize())} "
                    f"argument ({mode}). See the support table: {backend!r}.capabilities()."
                )
        self.operator, self.backend, self.f, self.options = operator, backend, f, options
        self.problem = Problem(operator.name, kinds, values, backend, wheres, keywords)
        if not placeholders_are_allowed():
            self._refuse_parameters_without_values()
        if operator.scalar_input:
            self._check_scalar_inputs(values)
        self.seeds = encode_seeds(operator, self.problem, seed_kwargs)
        self.seed_key = None if self.seeds is None else self.seeds.key
        self.pipeline = self.source_pipeline = operator.build(self.problem, f, backend, self.seeds, **options)

    def _refuse_parameters_without_values(self) -> None:
        where = self.problem.parameter_without_values()
        if where is not None:
            # accelerate's offloading loads such weights into fresh tensors inside the forward:
            # they are not the parameters, and its loader cannot rebuild a view's tensor (a TypeError deep inside).
            raise TypeError(
                f"activity.{self.operator.name}: {where} is on the meta device: it holds no values to "
                f"differentiate at (a model built on the meta device, or one whose weights accelerate offloads "
                f"with cpu_offload, disk_offload or a device_map and loads only inside its forward). Load the "
                f"weights onto a real device to differentiate the model; to differentiate other arguments "
                f"through it, pass it as Constant(...)."
            )

    def _check_scalar_inputs(self, values: tuple[Any, ...]) -> None:
        problem = self.problem
        for position in problem.active_positions:
            leaves, _ = flatten(values[position])
            for leaf, role in zip(leaves, problem.roles[position]):
                if role == "module" or (role == "diff" and arrays.shape(leaf) != ()):
                    raise ValueError(
                        f"activity.{self.operator.name} differentiates with respect to scalars, but Active "
                        f"argument {position} holds {describe_type(leaf)}"
                        f"{'' if role == 'module' else f' of shape {arrays.shape(leaf)}'}. "
                        f"Use activity.jacobian or activity.pushforward for array inputs."
                    )

    def compile(self) -> "Plan":
        self.pipeline = self.backend.compile(self.pipeline)
        return self

    def direct(self) -> Callable[[tuple[Any, ...], dict[Any, Any]], Any]:
        """The whole call, checks and split included, as one function of the arguments'
        values and the seed keywords: what `Backend.compile_call` compiles end to end."""
        operator, problem, pipeline, finalize = self.operator, self.problem, self.source_pipeline, self.backend.finalize

        def whole_call(values: tuple[Any, ...], seed_kwargs: dict[Any, Any]) -> Any:
            seeds = encode_seeds(operator, problem, seed_kwargs)
            xs, ctx = problem.split(values)
            return finalize(pipeline(xs, ctx, None if seeds is None else seeds.leaves), problem)

        return whole_call

    def run(self, values: tuple[Any, ...], seeds: Seeds | None, split: tuple[Any, ...] | None = None) -> Any:
        xs, ctx = split if split is not None else self.problem.split(values)
        extra = None if seeds is None else seeds.leaves
        with self.backend.context():
            return self.backend.finalize(self.pipeline(xs, ctx, extra), self.problem)


# (operator, kinds, backend, options) -> a backend's `reusable_call` for the latest signature.
_REUSABLE: dict[tuple[Any, ...], Callable[..., Any]] = {}


def call(
    operator: Operator,
    f: Callable[..., Any],
    args: Sequence[Any],
    backend: Backend | None,
    options: dict[str, Any],
    seed_kwargs: dict[str, Any],
    keywords: dict[str, Any] | None = None,
) -> Any:
    """An unprepared call: plan, then run; where the backend can reuse the work of the last
    call of the same signature (`Backend.reusable_call`), no plan is made. ``keywords`` are
    the annotated keyword arguments for f."""
    try:
        if keywords:
            check_keywords(operator, keywords)
        if isinstance(backend, Annotation):
            refuse_annotated_options(operator, {"backend": backend})
        for given in (options, seed_kwargs):
            for value in given.values():
                if isinstance(value, Annotation):
                    refuse_annotated_options(operator, given)
        return _call(operator, f, parse_call(operator.name, f, args, keywords), backend, options, seed_kwargs)
    except Exception as error:
        drop_jax_note(error)
        raise


def _call(
    operator: Operator, f: Callable[..., Any], arguments: Arguments, backend: Backend | None,
    options: dict[str, Any], seed_kwargs: dict[str, Any],
) -> Any:
    kinds, values = arguments.kinds, arguments.values
    signature = (operator.name, kinds, backend, tuple(options.items()))
    # Keyword arguments and masks are part of a signature the reused call does not check: planned each time.
    plain = not arguments.keywords and all(where is None for where in arguments.wheres)
    key: tuple[Any, ...] | None = signature if plain else None
    reusable: Callable[..., Any] | None = None
    try:
        reusable = None if key is None else _REUSABLE.get(signature)
    except TypeError:  # a backend (or option) that cannot be hashed: no reuse
        reusable, key = None, None
    if reusable is not None:
        try:
            return reusable(f, *values, **seed_kwargs)
        except SignatureChanged:
            pass
    plan = Plan(
        operator, f, kinds, values, backend, options, seed_kwargs, wheres=arguments.wheres, keywords=arguments.keywords
    )
    reusable = None if key is None else plan.backend.reusable_call(plan)
    if key is not None and reusable is not None:
        _keep(key, reusable, plan.problem)
        try:
            return reusable(f, *values, **seed_kwargs)
        except SignatureChanged:
            pass
    return plan.run(values, plan.seeds)


_KEYS_OF_MODULE: dict[int, set[tuple[Any, ...]]] = {}  # id(module) -> the keys of `_REUSABLE` made with it


def _keep(key: tuple[Any, ...], reusable: Callable[..., Any], problem: Problem) -> None:
    """Keep ``reusable`` for ``key`` while the modules it describes live (it holds their
    parameters): each module's death drops every entry made with it."""
    _REUSABLE[key] = reusable
    for module in problem.modules():
        keys = _KEYS_OF_MODULE.get(id(module))
        if keys is None:
            keys = _KEYS_OF_MODULE[id(module)] = set()
            weakref.finalize(module, _forget, id(module))
        keys.add(key)


def _forget(module_id: int) -> None:
    for key in _KEYS_OF_MODULE.pop(module_id, ()):
        _REUSABLE.pop(key, None)


# ------------------------------------------------------------------ pipeline helpers


def start(problem: Problem, f: Callable[..., Any], backend: Backend, xs: tuple[Any, ...], ctx: tuple[Any, ...], **flags: Any) -> tuple[Any, ...]:
    """The first lines of every pipeline: convert inputs, make ``F``."""
    xs, ctx = backend.convert_inputs(xs, ctx)
    traced = Traced()
    return xs, traced, backend.wrap_function(problem.function(f, ctx, traced, **flags), xs)


def blocks(batched: Any, sizes: list[int], shapes: list[tuple[Any, ...]], inner_shape: tuple[Any, ...], inner_first: bool) -> list[Any]:
    """Cut the leading batch axis of ``batched`` into one block per leaf of ``shapes``.

    Each block has shape ``shape + inner_shape`` (``inner_first=False``) or
    ``inner_shape + shape`` moved so that the result is always ``outer + inner``.
    """
    out, start_ = [], 0
    for n, shape in zip(sizes, shapes):
        block = arrays.reshape(batched[start_ : start_ + n], (*shape, *inner_shape))
        if inner_first:
            block = arrays.moveaxes_front_to_back(block, len(shape))
        out.append(block)
        start_ += n
    return out


def with_value(value_wanted: bool, value: Any, has_aux: bool, aux: Any, *derivatives: Any) -> Any:
    """Assemble ``derivative``, ``(derivative, aux)``, ``(value, ...)`` or ``((value, aux), ...)``."""
    if value_wanted:
        head = (value, aux) if has_aux else value
        return (head, *derivatives)
    result = derivatives[0] if len(derivatives) == 1 else derivatives
    return (result, aux) if has_aux else result


def per_seed(seeds: Seeds, batch_result: Callable[[int | None], Any]) -> Any:
    """One result for a single tangent, a list for a batch."""
    if seeds.batch is None:
        return batch_result(None)
    return [batch_result(b) for b in range(seeds.batch)]
