"""Argument types of the command line: each checks its value before anything runs, so a bad
option is a usage error (exit status 2, argparse's message naming the option)."""

from __future__ import annotations

import argparse

import torch

from shapecache.budget import parse_budget
from shapecache.scenarios._size_loop import STRATEGIES, parse_sizes


def sizes(text: str) -> list[tuple[int, int]]:
    try:
        return parse_sizes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def budget(text: str) -> str:
    try:
        parse_budget(text, argument="budget")
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def strategies(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in STRATEGIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown strategy {unknown[0]!r}; expected some of {', '.join(STRATEGIES)}")
    return names


def device(text: str) -> str:
    try:
        torch.device(text)
    except RuntimeError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text
