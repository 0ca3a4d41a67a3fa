import pytest

import shapecache as sc


def test_exact_keeps_every_size():
    policy = sc.exact()
    assert [policy.bucket(n) for n in (1, 7, 64, 65)] == [1, 7, 64, 65]
    assert not policy.pads


def test_multiple_of_rounds_up():
    policy = sc.multiple_of(8)
    assert [policy.bucket(n) for n in (1, 8, 9, 16, 17)] == [8, 8, 16, 16, 24]
    assert policy.pads


def test_power_of_two_rounds_up_with_minimum():
    assert [sc.power_of_two().bucket(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
    assert [sc.power_of_two(minimum=16).bucket(n) for n in (1, 16, 17)] == [16, 16, 32]


def test_explicit_sizes_sorted_and_deduplicated():
    policy = sc.one_of([128, 64, 96, 64])
    assert repr(policy) == "one_of([64, 96, 128])"
    assert [policy.bucket(n) for n in (1, 64, 65, 96, 100, 128)] == [64, 64, 96, 96, 128, 128]


def test_explicit_sizes_error_above_largest():
    with pytest.raises(IndexError, match="size 129 is above the largest bucket of one_of\\(\\[64, 128\\]\\)"):
        sc.one_of([64, 128]).bucket(129)


def test_empty_dimension_is_never_padded():
    assert sc.multiple_of(8).bucket(0) == 0


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda: sc.multiple_of(0), ValueError),
        (lambda: sc.multiple_of(2.5), TypeError),
        (lambda: sc.power_of_two(minimum=-1), ValueError),
        (lambda: sc.one_of([]), ValueError),
        (lambda: sc.one_of([0, 4]), ValueError),
        (lambda: sc.one_of(["8"]), TypeError),
    ],
)
def test_bad_policies_raise(make, error):
    with pytest.raises(error):
        make()
