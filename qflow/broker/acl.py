"""Access control lists in Qpid's ACL file syntax: parse a file's text, and
decide whether a user may do an action on an object. No I/O (the daemon
reads the file; the broker and the management API ask :meth:`Acl.check`).

The syntax and the decisions follow the Qpid C++ broker's ACL files
(docs/security.md, "Access control lists"):

* ``group NAME member...``: members are user names or groups defined above;
* ``acl allow|deny|allow-log|deny-log WHO ACTION [OBJECT [property=value ...]]``,
  ``WHO`` a user, a group or ``all``, ``ACTION`` and ``OBJECT`` may be ``all``;
* a line ending in ``\\`` continues on the next; a line starting with ``#`` is
  a comment (``#`` elsewhere is data: ``routingkey=stocks.#``);
* the first rule that matches decides; a rule ``acl ... all all`` (no
  properties) ends the list, and the rules after it are ignored, as qpidd
  does; when nothing matches the request is denied (qpidd's implicit final
  ``acl deny all all``);
* a property value ending in ``*`` matches every value with that prefix,
  except a rule's ``routingkey``, which is a topic pattern (``*`` one word,
  ``#`` zero or more), as in qpidd;
* a limit property (``queuemaxsizeupperlimit=N``...) out of bounds makes an
  allow rule that otherwise matches a deny, as in qpidd;
* ``user@QPID`` (qpidd's default realm) names the user ``user``: qflow's users
  have no realm.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from qflow import protocol as P
from qflow.broker.exchange import topic_matches
from qflow.protocol import CommandError

log = logging.getLogger("qflow.acl")

PERMISSIONS = ("allow", "allow-log", "deny", "deny-log")
ACTIONS = ("access", "bind", "unbind", "consume", "create", "delete", "publish", "purge", "update")
OBJECTS = ("broker", "exchange", "queue")
DEFAULT_REALM = "@QPID"

# The numeric limits of a queue's arguments a rule may bound: the property
# ``<base>lowerlimit=N`` matches a value >= N, ``<base>upperlimit=N`` one <= N.
LIMIT_ARGUMENTS = {
    "queuemaxsize": "qpid.max_size", "queuemaxcount": "qpid.max_count",
    "flowstopsize": "qpid.flow_stop_size", "flowstopcount": "qpid.flow_stop_count",
    "flowresumesize": "qpid.flow_resume_size", "flowresumecount": "qpid.flow_resume_count",
}
LIMITS = frozenset(base + bound for base in LIMIT_ARGUMENTS for bound in ("lowerlimit", "upperlimit"))

_QUEUE_SETTINGS = frozenset({"name", "durable", "autodelete", "exclusive", "policytype"}) | LIMITS
# Which actions apply to which objects, and the properties a request of each carries.
VALID: dict[tuple[str, str], frozenset[str]] = {
    ("access", "broker"): frozenset(),
    ("access", "exchange"): frozenset({"name"}),
    ("access", "queue"): frozenset({"name"}),
    ("bind", "exchange"): frozenset({"name", "queuename", "routingkey"}),
    ("unbind", "exchange"): frozenset({"name", "queuename", "routingkey"}),
    ("consume", "queue"): frozenset({"name"}),
    ("create", "exchange"): frozenset({"name", "type", "durable"}),
    ("create", "queue"): _QUEUE_SETTINGS,
    ("delete", "exchange"): frozenset({"name"}),
    ("delete", "queue"): frozenset({"name"}),
    ("publish", "exchange"): frozenset({"name", "routingkey"}),
    ("purge", "queue"): frozenset({"name"}),
    ("update", "broker"): frozenset(),
    ("update", "queue"): _QUEUE_SETTINGS,
}
PROPERTIES = frozenset().union(*VALID.values())
_BOOLEAN = frozenset({"durable", "autodelete", "exclusive"})


class AclError(Exception):
    """An ACL file the broker refuses: ``line`` (1-based) and what is wrong there."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line


class AclDenied(CommandError):
    """A request the ACL denies (code 530, not-allowed); the text says what."""

    def __init__(self, text: str) -> None:
        super().__init__(P.NOT_ALLOWED, text)


@dataclass(frozen=True)
class Rule:
    allow: bool
    log: bool
    users: frozenset[str] | None  # None: all
    pairs: frozenset[tuple[str, str]]  # the (action, object) pairs it covers
    props: tuple[tuple[str, str], ...]
    line: int
    topic: tuple[str, ...] | None  # the routingkey property as a topic pattern's words


def user_name(name: str) -> str:
    """A user as an ACL file names it, as qflow names it (no default realm)."""
    return name[:-len(DEFAULT_REALM)] if name.endswith(DEFAULT_REALM) and len(name) > len(DEFAULT_REALM) else name


def _lines(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, tokens) of each logical line: continuations joined, comments and blanks dropped."""
    out: list[tuple[int, list[str]]] = []
    pending: list[str] | None = None
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if pending is None and (not line or line.startswith("#")):
            continue
        continued = line.endswith("\\")
        if continued:
            line = line[:-1]
        tokens = line.split()
        if pending is None:
            pending, start = tokens, number
        else:
            if not tokens:
                raise AclError(number, "an empty continuation line")
            pending += tokens
        if not continued:
            out.append((start, pending))
            pending = None
    if pending is not None:
        raise AclError(start, "the last line ends with '\\' but nothing follows")
    return out


def _value(line: int, key: str, value: str) -> str:
    if not value:
        raise AclError(line, f"property {key!r} has no value")
    if key in LIMITS:
        if not value.isdigit():
            raise AclError(line, f"property {key!r} must be a whole number of 0 or more, not {value!r}")
    elif key in _BOOLEAN and value.lower() not in ("true", "false"):
        raise AclError(line, f"property {key!r} must be true or false, not {value!r}")
    return value.lower() if key in _BOOLEAN else value


def parse(text: str) -> Acl:
    """The rules of an ACL file's ``text``; raises AclError naming the first bad line."""
    groups: dict[str, frozenset[str]] = {}
    rules: list[Rule] = []
    ended = 0
    for line, tokens in _lines(text):
        word = tokens[0]
        if word == "group":
            if len(tokens) < 3:
                raise AclError(line, "expected 'group NAME MEMBER...'")
            name = tokens[1]
            if name == "all" or name in PERMISSIONS or "=" in name:
                raise AclError(line, f"{name!r} cannot name a group")
            if name in groups:
                raise AclError(line, f"group {name!r} is defined twice")
            members: set[str] = set()
            for member in tokens[2:]:
                members |= groups.get(member) or {user_name(member)}
            groups[name] = frozenset(members)
            continue
        if word != "acl":
            raise AclError(line, f"expected 'acl' or 'group', not {word!r}")
        if len(tokens) < 4:
            raise AclError(line, "expected 'acl PERMISSION USER|GROUP|all ACTION|all [OBJECT|all [property=value ...]]'")
        permission, who, action = tokens[1], tokens[2], tokens[3]
        if permission not in PERMISSIONS:
            raise AclError(line, f"permission must be one of {', '.join(PERMISSIONS)}, not {permission!r}")
        if action != "all" and action not in ACTIONS:
            raise AclError(line, f"action must be all or one of {', '.join(ACTIONS)}, not {action!r}")
        obj = tokens[4] if len(tokens) > 4 else "all"
        if obj != "all" and obj not in OBJECTS:
            raise AclError(line, f"object must be all or one of {', '.join(OBJECTS)}, not {obj!r}")
        props: dict[str, str] = {}
        for token in tokens[5:]:
            key, sep, value = token.partition("=")
            if not sep:
                raise AclError(line, f"expected property=value, not {token!r}")
            key = key.lower()
            if key not in PROPERTIES:
                raise AclError(line, f"unknown property {key!r} (known: {', '.join(sorted(PROPERTIES))})")
            if key in props:
                raise AclError(line, f"property {key!r} given twice")
            props[key] = _value(line, key, value)
        pairs = frozenset(pair for pair in VALID
                          if action in ("all", pair[0]) and obj in ("all", pair[1]) and set(props) <= VALID[pair])
        if not pairs:
            raise AclError(line, f"no {action} {obj} request has the properties {', '.join(props) or '(none)'}"
                           if (action == "all" or obj == "all" or (action, obj) in VALID)
                           else f"action {action!r} does not apply to object {obj!r}")
        users = None if who == "all" else groups.get(who) or frozenset({user_name(who)})
        if ended:
            log.warning("ACL line %d is ignored: the rule on line %d (acl ... all all) ends the list", line, ended)
            continue
        topic = tuple(props["routingkey"].split(".")) if "routingkey" in props else None
        rules.append(Rule(permission.startswith("allow"), permission.endswith("-log"), users, pairs,
                          tuple(props.items()), line, topic))
        if who == "all" and action == "all" and obj == "all" and not props:
            ended = line
    return Acl(rules, groups)


def _matches(rule: Rule, request: dict[str, Any]) -> tuple[bool, bool]:
    """(whether ``rule`` matches ``request``, whether the request is within its limits)."""
    within = True
    for key, want in rule.props:
        if key in LIMITS:
            got = request.get(key[:-len("lowerlimit")])  # "lowerlimit" and "upperlimit": the same length
            if type(got) is not int:
                return False, True  # a limit rule matches only a request that names the limit
            if got < int(want) if key.endswith("lowerlimit") else got > int(want):
                within = False
            continue
        got = request.get(key)
        if got is None:
            return False, True
        got = str(got).lower() if type(got) is bool else str(got)
        if key == "routingkey":
            if not topic_matches(list(rule.topic or ()), got.split(".") if got else []):
                return False, True
        elif want.endswith("*"):
            if not got.startswith(want[:-1]):
                return False, True
        elif got != want:
            return False, True
    return True, within


def describe(user: str, action: str, obj: str, request: dict[str, Any]) -> str:
    """A request as the denial and the log name it: ``alice publish exchange name=amq.default routingkey=q``."""
    props = " ".join(f"{k}={str(v).lower() if type(v) is bool else v}" for k, v in request.items() if v is not None)
    return f"{user} {action} {obj}" + (f" {props}" if props else "")


class Acl:
    """The rules of one ACL file, in order."""

    def __init__(self, rules: list[Rule], groups: dict[str, frozenset[str]]) -> None:
        self.rules = rules
        self.groups = groups

    def decide(self, user: str, action: str, obj: str, request: dict[str, Any]) -> tuple[Rule | None, bool]:
        """The first rule that matches the request (None: none does, denied),
        and whether it allows: an allow rule whose limits the request exceeds denies."""
        pair = (action, obj)
        for rule in self.rules:
            if pair in rule.pairs and (rule.users is None or user in rule.users):
                match, within = _matches(rule, request)
                if match:
                    return rule, rule.allow and within
        return None, False

    def check(self, user: str, action: str, obj: str, request: dict[str, Any]) -> None:
        """Raise AclDenied unless ``user`` may do ``action`` on ``obj`` with
        the properties ``request`` (a queue's limits by their base names:
        ``queuemaxsize``...); log it if the deciding rule says ``-log``."""
        rule, allowed = self.decide(user, action, obj, request)
        if allowed and not rule.log:  # type: ignore[union-attr]
            return
        text = describe(user, action, obj, request)
        if rule is not None and rule.log:
            log.info("ACL %s (line %d): %s", "allowed" if allowed else "denied", rule.line,
                     text.encode("unicode_escape").decode("ascii"))
        if not allowed:
            raise AclDenied(f"not allowed: {text}")

    def may(self, user: str, action: str, obj: str, request: dict[str, Any]) -> bool:
        """Whether ``user`` may; no log (views filtered by what each user may see)."""
        return self.decide(user, action, obj, request)[1]


def queue_request(name: str, arguments: dict[str, Any], **flags: Any) -> dict[str, Any]:
    """The properties of a create or update of queue ``name`` with ``arguments``."""
    request: dict[str, Any] = {"name": name, **flags}
    policy = arguments.get("qpid.policy_type")
    if type(policy) is str:
        request["policytype"] = policy
    for base, key in LIMIT_ARGUMENTS.items():
        value = arguments.get(key)
        if type(value) is int:
            request[base] = value
    return request
