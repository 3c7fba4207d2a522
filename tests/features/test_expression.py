"""The expression language of expr_feature and normalizers: muParser's operators and functions
(TorchEasyRec's), named variables, vectors a row, and a named error for what it cannot take."""

import math

import numpy as np
import pytest

from dynarec.features.expression import Expression


def value(text: str, **env) -> float:
    names = list(env) or ["x"]
    arrays = {k: np.array([float(v)]) for k, v in env.items()} or {"x": np.array([0.0])}
    return float(Expression(text, names).evaluate(arrays, 1)[0])


@pytest.mark.parametrize(
    "text, want",
    [
        ("2^3", 8.0),
        ("2^3^2", 512.0),  # right-associative
        ("-2^2", -4.0),  # the sign binds looser than ^
        ("2^-1", 0.5),
        ("2**3", 8.0),  # dynarec's earlier power operator, kept
        ("1 + 2 * 3 - 4 / 2", 5.0),
        ("(1 + 2) * 3", 9.0),
        ("log(_e)", 1.0),  # log is the natural log (criteo's log(x+3))
        ("ln(_e^2)", 2.0),
        ("log10(1000) + log2(8)", 6.0),
        ("3 > 2", 1.0),
        ("3 <= 2", 0.0),
        ("2 == 2 && 1 != 1", 0.0),
        ("0 || 2", 1.0),
        ("5 & 3 | 8", 9.0),  # bitwise, & before |
        ("1 < 2 ? 10 : 20", 10.0),
        ("0 ? 1 : 0 ? 2 : 3", 3.0),
        ("min(3, 1, 2) + max(3, 1, 2) + sum(1, 2, 3) + avg(2, 4)", 13.0),
        ("round(2.5) + round(-2.5) + rint(2.5)", 2.0),  # half away from zero; rint to even
        ("roundp(3.14159, 2)", 3.14),
        ("mod(7, 3) + mod(-7, 3)", 0.0),  # fmod: the sign of the dividend
        ("sigmoid(0)", 0.5),
        ("abs(-3) + sign(-2) + sqrt(16) + exp(0) + floor(1.7) + ceil(1.2) + trunc(-1.7)", 9.0),
        ("6 - 4 / 2 - 1", 3.0),
        ("8 / 2 / 2", 2.0),
        ("_pi", math.pi),
        ("isnan(0)", 0.0),
    ],
)
def test_operators_and_functions(text, want):
    assert value(text) == pytest.approx(want)


def test_named_variables_and_the_normalizer_form():
    assert value("a ^ 2 + b", a=3, b=1) == 10.0
    x = np.array([1.0, 2.0, 3.0])
    np.testing.assert_allclose(Expression("log(x+3)")(x), np.log(x + 3))
    e = Expression("raw_1 + raw_2", ["raw_1", "raw_2"])
    assert e.names == {"raw_1", "raw_2"}
    np.testing.assert_allclose(
        e.evaluate({"raw_1": np.array([0.1, 1.0]), "raw_2": np.array([0.2, 2.0])}, 2), [0.3, 3.0]
    )


def test_vector_functions_reduce_a_rows_numbers():
    a = np.array([[1.0, 2.0, 3.0], [0.0, 3.0, 4.0]])
    b = np.array([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    run = lambda text: Expression(text, ["a", "b"]).evaluate({"a": a, "b": b}, 2).tolist()
    assert run("dot(a, b)") == [6.0, 0.0]
    assert run("l2_norm(a)") == pytest.approx([math.sqrt(14), 5.0])
    assert run("squared_norm(a) + len(a)") == [17.0, 28.0]
    assert run("reduce_sum(a) + reduce_min(a) + reduce_max(a)") == [10.0, 11.0]
    assert run("reduce_mean(a) * reduce_prod(b)") == [2.0, 0.0]
    assert run("euclid_dist(a, b)") == pytest.approx([math.sqrt(5), math.sqrt(1 + 9 + 16)])
    assert run("variance(a)") == pytest.approx([1.0, np.var([0, 3, 4], ddof=1)])
    assert run("pop_std_dev(a)") == pytest.approx([np.std([1, 2, 3]), np.std([0, 3, 4])])
    assert run("corr(a, a)") == pytest.approx([1.0, 1.0])
    assert Expression("a * 2", ["a", "b"]).evaluate({"a": a, "b": b}, 2).tolist() == (a * 2).tolist()


def test_distances_on_the_sphere_in_km():
    beijing, shanghai = (116.4074, 39.9042), (121.4737, 31.2304)
    env = {k: np.array([v]) for k, v in zip(["lng1", "lat1", "lng2", "lat2"], [*beijing, *shanghai])}
    for fn in ("haversine", "sphere_dist"):
        km = Expression(f"{fn}(lng1, lat1, lng2, lat2)", list(env)).evaluate(env, 1)[0]
        assert 1060 < km < 1075  # Beijing - Shanghai, about 1068 km


@pytest.mark.parametrize(
    "text, variables, message",
    [
        ("y + 1", ["x"], "unknown variable 'y'; its variables: \\['x'\\]"),
        ("foo(x)", ["x"], "unknown function 'foo'"),
        ("log(x, 2)", ["x"], r"log\(\) takes 1 argument\(s\), got 2"),
        ("roundp(x)", ["x"], r"roundp\(\) takes 2 argument\(s\), got 1"),
        ("x +", ["x"], "ends too early"),
        ("(x", ["x"], r"ends too early \(expected '\)'\)"),
        ("x $ 2", ["x"], "unexpected '\\$' at position 2"),
        ("x 2", ["x"], "unexpected '2' at position 2"),
        ("", ["x"], "is empty"),
        ("__import__(x)", ["x"], "unknown function '__import__'"),
    ],
)
def test_what_it_cannot_take_is_named(text, variables, message):
    with pytest.raises(ValueError, match=message):
        Expression(text, variables)
