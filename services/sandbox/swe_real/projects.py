"""The projects real-repository tasks are made from: small pure-Python libraries whose sdists
carry their own pytest suites that run in seconds. Versions are exact, so a task set rebuilt from
the same seed is the same task set."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Project:
    name: str  # the distribution on the package index
    version: str
    src: tuple[str, ...]  # files or packages (relative to the sdist root) bugs are injected into
    tests: tuple[str, ...]  # what pytest runs (relative to the sdist root)
    pythonpath: tuple[str, ...] = (".",)  # where the package is importable from (src layouts)
    test_deps: tuple[str, ...] = ()  # besides pytest, installed into the read-only base

    @property
    def key(self) -> str:
        return f"{self.name}-{self.version}"


PROJECTS: tuple[Project, ...] = (
    Project("inflection", "0.5.1", ("inflection/__init__.py",), ("test_inflection.py",)),
    Project("text-unidecode", "1.3", ("src/text_unidecode/__init__.py",), ("test_unidecode.py",), ("src",)),
    Project("six", "1.17.0", ("six.py",), ("test_six.py",)),
    Project(
        "toolz", "1.2.0", ("toolz/itertoolz.py", "toolz/functoolz.py", "toolz/dicttoolz.py"), ("toolz/tests",)
    ),
    Project(
        "cachetools", "8.0.3", ("src/cachetools/__init__.py", "src/cachetools/func.py"), ("tests",), ("src",)
    ),
    Project("tabulate", "0.10.0", ("tabulate/__init__.py",), ("test",)),
    Project("parse", "1.22.4", ("parse/__init__.py",), ("tests",)),
    Project("semver", "3.2.0", ("src/semver/version.py", "src/semver/_deprecated.py"), ("tests",), ("src",)),
    Project(
        "jmespath", "1.1.0", ("jmespath/lexer.py", "jmespath/parser.py", "jmespath/functions.py"), ("tests",)
    ),
    Project(
        "itsdangerous",
        "2.2.0",
        (
            "src/itsdangerous/signer.py",
            "src/itsdangerous/url_safe.py",
            "src/itsdangerous/timed.py",
            "src/itsdangerous/encoding.py",
        ),
        ("tests",),
        ("src",),
        ("freezegun",),
    ),  # fmt: skip
    Project("pathspec", "1.1.1", ("pathspec/patterns/gitignore/spec.py", "pathspec/util.py"), ("tests",)),
    Project(
        "boltons",
        "26.2.0",
        ("boltons/strutils.py", "boltons/iterutils.py", "boltons/dictutils.py"),
        ("tests/test_strutils.py", "tests/test_iterutils.py", "tests/test_dictutils.py"),
    ),  # fmt: skip
)

BY_NAME = {p.name: p for p in PROJECTS}
