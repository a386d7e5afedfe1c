"""An offline bundle for `python -m benchmarks.gpu_check`: on a networked machine, the wheels a GPU
machine with its own torch, triton and transformers lacks to run the check from a plain checkout.

    python -m benchmarks.gpu_bundle DIR          # here: needs pip and the package index
    # copy DIR and the checkout to the GPU machine; there, from the checkout (or naming it):
    bash DIR/run.sh [CHECKOUT] [-- gpu_check arguments]
    bash DIR/run.sh --install-only               # install and verify only (CI does this)

What ships (DIR/wheels, each with its reason in DIR/manifest.json): transformers in pyproject's
range, stateful_hf's own small requirements (OWN: sortedcontainers, xxhash, threadpoolctl), and each
requirement of a shipped package that the image may not meet. The image is assumed
to meet its own transformers' requirements (`--image-transformers`, 5.17.0 by default: a CUDA image
with torch 2.11+cu130, triton 3.6 and transformers 5.17) at the oldest versions they allow: a
requirement is shipped when its range does not hold every version the image's range allows (a higher
floor, a new cap, a package the image's transformers did not need), at the newest version inside
both ranges when there is one; a shipped package's own requirements are followed the same way,
against those of its oldest version the image may hold. Wheels only (`--only-binary=:all:`), for
CPython `--python-version` on manylinux x86-64 (glibc up to `--glibc`); `pip download --no-deps`
with exact versions, so nothing else comes along. Not shipped: stateful-hf (run from the checkout),
torch and triton (the image's CUDA builds), and what the check does not import (see NOT_SHIPPED).

run.sh installs the wheels with `python3 -m pip install --no-index --no-deps --target SITE` (SITE:
`--site`, else $STATEFUL_HF_SITE, else ${TMPDIR:-/tmp}/stateful-hf-site), leaving the image's own
environment untouched (it may be read-only or shared), puts SITE first on PYTHONPATH, checks that
transformers now imports from SITE at the shipped version and the check from the checkout without
the web stack or gguf, then runs the check from the checkout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parent.parent
ROOT_PACKAGE = "transformers"
NOT_SHIPPED = {
    "stateful-hf": "runs from the checkout: `import stateful_hf` works from its root, no install",
    "torch, triton": "the image's own CUDA builds (tied to its driver and CUDA); the check records their versions",
    "flashinfer-python, flash-attn": "optional backends: the check lists them as skipped when absent",
    "gguf": "imported only by transformers' GGUF loader (stateful_hf.models' convert), not by the check",
    "fastapi, uvicorn, pydantic, gradio, ray, openai": "the server, demo and cluster: not imported by the check "
                                                      "or by `pytest -m cuda`",
}


# ---- version ranges ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Bound:
    """One end of a version range: the version and whether it is included."""

    version: Version
    inclusive: bool


def _next_release(version: Version, parts: int) -> Version:
    """The first release past the first `parts` numbers of `version` (`~=1.4.2`'s cap: 1.5)."""
    release = list(version.release[:parts])
    release[-1] += 1
    return Version(".".join(map(str, release)))


def bounds(spec: SpecifierSet) -> tuple[Bound | None, Bound | None]:
    """(floor, cap) of a range; None where it has none. `!=` clauses are left out (see `covers`)."""
    floor: Bound | None = None
    cap: Bound | None = None

    def tighter(a: Bound | None, b: Bound, is_floor: bool) -> Bound:
        """The narrower of two floors (the higher) or caps (the lower); at a tie, the exclusive one."""
        if a is None:
            return b
        if a.version != b.version:
            return b if (b.version > a.version) == is_floor else a
        return a if not a.inclusive else b

    for clause in spec:
        op, text = clause.operator, clause.version
        if op in ("==", "===") and text.endswith(".*"):
            v = Version(text[:-2])
            floor, cap = tighter(floor, Bound(v, True), True), tighter(cap, Bound(_next_release(v, len(v.release)),
                                                                                   False), False)
        elif op in ("==", "==="):
            floor, cap = tighter(floor, Bound(Version(text), True), True), tighter(cap, Bound(Version(text), True),
                                                                                  False)
        elif op == "~=":
            v = Version(text)
            floor = tighter(floor, Bound(v, True), True)
            cap = tighter(cap, Bound(_next_release(v, max(len(v.release) - 1, 1)), False), False)
        elif op in (">=", ">"):
            floor = tighter(floor, Bound(Version(text), op == ">="), True)
        elif op in ("<=", "<"):
            cap = tighter(cap, Bound(Version(text), op == "<="), False)
    return floor, cap


def _inside(old: Bound | None, new: Bound | None, is_floor: bool) -> bool:
    """Whether one end of the old range lies within the same end of the new one (None: unbounded)."""
    if new is None:
        return True
    if old is None:
        return False
    if old.version != new.version:
        return (old.version > new.version) == is_floor
    return new.inclusive or not old.inclusive


def covers(new: SpecifierSet, old: SpecifierSet | None) -> bool:
    """True when every version `old` allows, `new` allows too (so a package meeting `old`, as the
    image's does, meets `new`). `old` None: the image was never asked for the package, nothing is known."""
    if old is None:
        return not str(new)
    (new_floor, new_cap), (old_floor, old_cap) = bounds(new), bounds(old)
    if not (_inside(old_floor, new_floor, True) and _inside(old_cap, new_cap, False)):
        return False
    for clause in new:                       # an excluded version the old range still allows
        if clause.operator == "!=" and old.contains(clause.version.removesuffix(".*"), prereleases=True):
            return False
    return True


def oldest_allowed(spec: SpecifierSet | None) -> str | None:
    """The oldest version a range names as allowed (its inclusive floor), or None."""
    floor = bounds(spec)[0] if spec is not None else None
    return str(floor.version) if floor is not None and floor.inclusive else None


# ---- asking the index (pip) --------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Target:
    """The GPU machine's interpreter and platform, as pip's wheel-selection flags and marker values."""

    python_version: str = "3.12"
    glibc: str = "2.28"
    machine: str = "x86_64"

    def platforms(self) -> list[str]:
        """manylinux tags up to `glibc` (pip matches each exactly), with the legacy aliases."""
        major, minor = (int(x) for x in self.glibc.split("."))
        tags = [f"manylinux_{major}_{m}_{self.machine}" for m in range(minor, 4, -1)]
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        return tags + [f"{name}_{self.machine}" for m, name in legacy.items() if m <= minor]

    def pip_flags(self) -> list[str]:
        flags = ["--only-binary=:all:", "--implementation", "cp", "--python-version", self.python_version]
        for platform in self.platforms():
            flags += ["--platform", platform]
        return flags

    def markers(self) -> dict[str, str]:
        env = dict(default_environment())
        env.update(python_version=self.python_version, python_full_version=f"{self.python_version}.0",
                   sys_platform="linux", platform_system="Linux", os_name="posix", platform_machine=self.machine,
                   implementation_name="cpython", platform_python_implementation="CPython", extra="")
        return env


@dataclass(frozen=True, slots=True)
class Release:
    """One version of a package as the index describes it (pip's installation report)."""

    name: str                      # canonical
    version: str
    requires: tuple[str, ...]      # Requires-Dist lines
    sha256: str | None


def resolve(requirement: str, target: Target) -> Release | None:
    """The release pip would pick for `requirement` on `target` (newest allowed; metadata only, no
    download: `pip install --dry-run --report`), or None when no release matches."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet",
               "--disable-pip-version-check", "--report", str(report), "--target", str(Path(tmp) / "t"),
               *target.pip_flags(), requirement]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            if "No matching distribution" in r.stderr or "Could not find a version" in r.stderr:
                return None
            raise RuntimeError(f"pip could not resolve {requirement!r}:\n{r.stderr.strip()[-2000:]}")
        (item,) = json.loads(report.read_text())["install"]
    meta, info = item["metadata"], item["download_info"]
    return Release(canonicalize_name(meta["name"]), meta["version"], tuple(meta.get("requires_dist", ())),
                   info.get("archive_info", {}).get("hashes", {}).get("sha256"))


# ---- what to ship ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Shipped:
    """One wheel of the bundle and why: `required` by `parent`, where the image's range was `image_had`."""

    name: str
    version: str
    required: str
    parent: str
    image_had: str | None
    why: str
    sha256: str | None


@dataclass(frozen=True, slots=True)
class Plan:
    """The bundle's contents: shipped releases, and requirements left to the image with the reason."""

    shipped: dict[str, Shipped] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)          # requirement -> why the image meets it
    image_ranges: dict[str, SpecifierSet] = field(default_factory=dict)


def requirements(release: Release, target: Target) -> list[Requirement]:
    """A release's own requirements on `target` (markers evaluated, extras left out)."""
    env = target.markers()
    reqs = [Requirement(line) for line in release.requires]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env)]


def pyproject_pin(pyproject: Path, package: str = ROOT_PACKAGE) -> SpecifierSet:
    """`package`'s range in pyproject.toml's [project] dependencies."""
    try:
        import tomllib
    except ModuleNotFoundError:            # Python 3.10
        import tomli as tomllib

    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    for line in deps:
        req = Requirement(line)
        if canonicalize_name(req.name) == canonicalize_name(package):
            return req.specifier
    raise ValueError(f"{pyproject}: [project] dependencies name no {package}")


def plan_bundle(pin: SpecifierSet, image_transformers: str, target: Target, log=print) -> Plan:
    """Transformers in `pin`, then breadth-first every requirement of a shipped release that the image
    (assumed to meet transformers `image_transformers`'s requirements, at their oldest) may not meet."""
    plan = Plan()
    new = resolve(f"{ROOT_PACKAGE}{pin}", target)
    old = resolve(f"{ROOT_PACKAGE}=={image_transformers}", target)
    if new is None:
        raise RuntimeError(f"no wheel of {ROOT_PACKAGE}{pin} for {target}")
    if old is None:
        raise RuntimeError(f"no wheel of {ROOT_PACKAGE}=={image_transformers} (--image-transformers) to read its "
                           "requirements from")
    for req in requirements(old, target):
        plan.image_ranges[canonicalize_name(req.name)] = (
            plan.image_ranges.get(canonicalize_name(req.name), SpecifierSet()) & req.specifier)
    plan.shipped[new.name] = Shipped(new.name, new.version, str(pin), "pyproject.toml", f"=={image_transformers}",
                                     f"pyproject pins {ROOT_PACKAGE}{pin}; the image has {image_transformers}",
                                     new.sha256)
    log(f"ship {new.name} {new.version}: {plan.shipped[new.name].why}")
    queue = deque([(new, old)])      # (shipped release, the oldest release of it the image may hold, or None)
    while queue:
        release, image_release = queue.popleft()
        if image_release is not None:
            for req in requirements(image_release, target):
                name = canonicalize_name(req.name)
                plan.image_ranges[name] = plan.image_ranges.get(name, SpecifierSet()) & req.specifier
        for req in requirements(release, target):
            name = canonicalize_name(req.name)
            label = f"{name}{req.specifier}"
            if name in plan.shipped:
                if not req.specifier.contains(plan.shipped[name].version, prereleases=True):
                    raise RuntimeError(f"{release.name} {release.version} needs {label}, but the bundle ships "
                                       f"{name} {plan.shipped[name].version} ({plan.shipped[name].why})")
                continue
            had = plan.image_ranges.get(name)
            if covers(req.specifier, had):
                plan.kept[label] = (f"the image's range {name}{had} lies inside it" if str(req.specifier)
                                    else "any version serves")
                continue
            both = resolve(f"{name}{req.specifier & had}", target) if had is not None and str(had) else None
            chosen = both or resolve(f"{name}{req.specifier}", target)
            if chosen is None:
                raise RuntimeError(f"no wheel of {label} for {target} ({release.name} {release.version} needs it)")
            if had is None:
                why = f"{release.name} {release.version} needs {label}; nothing the image holds was known to need it"
            else:
                why = f"{release.name} {release.version} needs {label}; the image's range was {name}{had or ' (any)'}"
                why += "" if both is not None else "; no release lies in both ranges"
            plan.shipped[name] = Shipped(name, chosen.version, str(req.specifier), release.name,
                                         str(had) if had is not None else None, why, chosen.sha256)
            log(f"ship {name} {chosen.version}: {why}")
            oldest = oldest_allowed(had)
            queue.append((chosen, resolve(f"{name}=={oldest}", target) if oldest else None))
    return plan


def download(plan: Plan, wheels: Path, target: Target) -> dict[str, Path]:
    """`pip download --no-deps` of exactly the shipped versions into `wheels`; checks each file's sha256
    against the index's. Returns name -> wheel file."""
    wheels.mkdir(parents=True, exist_ok=True)
    pins = [f"{s.name}=={s.version}" for s in plan.shipped.values()]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check", "-d",
           str(wheels), *target.pip_flags(), *pins]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        raise RuntimeError(f"pip download failed:\n{r.stderr.strip()[-2000:]}")
    files: dict[str, Path] = {}
    for path in sorted(wheels.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        shipped = plan.shipped.get(canonicalize_name(name))
        if shipped is None or str(version) != str(Version(shipped.version)):
            path.unlink()                    # a leftover of an earlier build into the same folder
            continue
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if shipped.sha256 is not None and digest != shipped.sha256:
            raise RuntimeError(f"{path.name}: sha256 {digest} is not the index's {shipped.sha256}")
        files[shipped.name] = path
    missing = sorted(set(plan.shipped) - set(files))
    if missing:
        raise RuntimeError(f"pip download brought no wheel of {missing}")
    return files


# ---- run.sh ------------------------------------------------------------------------------------------

RUN_SH = r"""#!/usr/bin/env bash
# Offline run of stateful-hf's GPU check; made by `python -m benchmarks.gpu_bundle` (manifest.json: what and why).
#   bash run.sh [--install-only] [--site SITE] [CHECKOUT] [-- gpu_check arguments]
# Installs wheels/*.whl with pip --no-index --no-deps into SITE (default $STATEFUL_HF_SITE, else
# ${TMPDIR:-/tmp}/stateful-hf-site), not into the image's environment, and puts SITE first on PYTHONPATH.
# Checks that transformers imports from SITE at the shipped version and that the check imports from CHECKOUT
# (default: the current directory; no install needed) without the web stack or gguf. Then, unless
# --install-only, runs `python3 -m benchmarks.gpu_check` there with the arguments after `--` (default:
# --json benchmarks/results/gpu_check.json). $PYTHON overrides python3. --install-only checks CHECKOUT only when
# given. Exit status: non-zero when pip or a check fails; else 0 (--install-only) or gpu_check's (1: a section failed).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
site="${STATEFUL_HF_SITE:-${TMPDIR:-/tmp}/stateful-hf-site}"
install_only=0
checkout=""
args=(--json benchmarks/results/gpu_check.json)
while [ $# -gt 0 ]; do
  case "$1" in
    --install-only) install_only=1 ;;
    --site) site="$2"; shift ;;
    --) shift; [ $# -gt 0 ] && args=("$@"); break ;;
    -h|--help) sed -n '2,10p' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) echo "run.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) checkout="$1" ;;
  esac
  shift
done
[ -z "$checkout" ] && [ "$install_only" = 0 ] && checkout="$PWD"
if [ -n "$checkout" ]; then
  if [ ! -f "$checkout"/stateful_hf/__init__.py ] || [ ! -f "$checkout"/benchmarks/gpu_check.py ]; then
    echo "run.sh: $checkout is not a stateful-hf checkout (give its path, or run from its root)" >&2
    exit 2
  fi
  checkout="$(cd "$checkout" && pwd)"
fi
mkdir -p "$site"
site="$(cd "$site" && pwd)"
"$python" -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --quiet \
  --disable-pip-version-check --target "$site" "$here"/wheels/*.whl
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
(cd "${TMPDIR:-/tmp}" && PYTHONPATH="$PYTHONPATH${checkout:+:$checkout}" \
  "$python" - "$here/manifest.json" "$site" "$checkout" <<'PY'
import json, os, sys
manifest, site, checkout = json.load(open(sys.argv[1])), os.path.realpath(sys.argv[2]), sys.argv[3]
for name in ("fastapi", "uvicorn", "pydantic", "gguf", "gradio", "ray", "openai"):
    sys.modules[name] = None            # absent on a GPU image: nothing the check imports may need them
want = {w["name"]: w["version"] for w in manifest["wheels"]}["transformers"]
import transformers
where = os.path.realpath(transformers.__file__)
if transformers.__version__ != want or not where.startswith(site + os.sep):
    sys.exit(f"run.sh: transformers {transformers.__version__} imports from {where}, not {want} from {site}")
print(f"run.sh: transformers {want} from {site}")
if checkout:
    import benchmarks.gpu_check, stateful_hf, stateful_hf.cache, stateful_hf.kernels
    for module in (stateful_hf, stateful_hf.cache, stateful_hf.kernels, benchmarks.gpu_check):
        if not os.path.realpath(module.__file__).startswith(os.path.realpath(checkout) + os.sep):
            sys.exit(f"run.sh: {module.__name__} imports from {module.__file__}, not from {checkout}")
    print(f"run.sh: stateful_hf and benchmarks.gpu_check from {checkout}")
PY
)
[ "$install_only" = 1 ] && exit 0
cd "$checkout"
mkdir -p benchmarks/results
exec "$python" -m benchmarks.gpu_check "${args[@]}"
"""


def git_commit() -> str:
    try:
        r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=20)
        return r.stdout.strip() if r.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# stateful_hf's own requirements that a CUDA image need not hold (transformers does not need them)
OWN = ("sortedcontainers", "xxhash", "threadpoolctl")


def ship_own(plan: Plan, pyproject: Path, target: Target, log=print) -> None:
    """Add OWN, each at the newest wheel in pyproject's range, unless transformers' plan ships it already."""
    for name in OWN:
        if name in plan.shipped:
            continue
        spec = pyproject_pin(pyproject, name)
        chosen = resolve(f"{name}{spec}", target)
        if chosen is None:
            raise RuntimeError(f"no wheel of {name}{spec} for {target} (stateful_hf imports it)")
        plan.shipped[name] = Shipped(name, chosen.version, str(spec), "pyproject.toml", None,
                                     f"stateful_hf imports it ({name}{spec}); a CUDA image need not hold it",
                                     chosen.sha256)
        log(f"ship {name} {chosen.version}: {plan.shipped[name].why}")


def build(out: Path, target: Target, image_transformers: str, pyproject: Path) -> dict:
    """Plan, download and describe the bundle in `out` (wheels/, manifest.json, run.sh). Returns the manifest."""
    pin = pyproject_pin(pyproject)
    plan = plan_bundle(pin, image_transformers, target)
    ship_own(plan, pyproject, target)
    files = download(plan, out / "wheels", target)
    manifest = {
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": git_commit(),
        "pyproject": {ROOT_PACKAGE: str(pin)}, "image_transformers": image_transformers,
        "target": {"python_version": target.python_version, "platforms": target.platforms()},
        "wheels": [{"name": s.name, "version": s.version, "file": f"wheels/{files[s.name].name}",
                    "sha256": hashlib.sha256(files[s.name].read_bytes()).hexdigest(),
                    "pure": files[s.name].name.endswith("-none-any.whl"), "required": s.required,
                    "by": s.parent, "image_range": s.image_had, "why": s.why} for s in plan.shipped.values()],
        "left_to_the_image": plan.kept, "not_shipped": NOT_SHIPPED,
        "run": "bash DIR/run.sh [CHECKOUT] [-- gpu_check arguments]; bash DIR/run.sh --install-only",
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (out / "run.sh").write_text(RUN_SH)
    (out / "run.sh").chmod(0o755)
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_bundle", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path, help="where to write wheels/, manifest.json and run.sh")
    ap.add_argument("--python-version", default="3.12", help="the GPU machine's Python, X.Y (default 3.12)")
    ap.add_argument("--glibc", default="2.28", help="newest manylinux glibc to accept for binary wheels (default 2.28)")
    ap.add_argument("--machine", default="x86_64", help="the GPU machine's architecture (default x86_64)")
    ap.add_argument("--image-transformers", default="5.17.0",
                    help="the transformers version the GPU machine's image holds (default 5.17.0)")
    ap.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        Version(args.image_transformers)
    except InvalidVersion:
        ap.error(f"--image-transformers: {args.image_transformers!r} is not a version (e.g. 5.17.0)")
    target = Target(args.python_version, args.glibc, args.machine)
    args.dir.mkdir(parents=True, exist_ok=True)
    manifest = build(args.dir, target, args.image_transformers, args.pyproject)
    total = sum((args.dir / w["file"]).stat().st_size for w in manifest["wheels"])
    print(f"wrote {len(manifest['wheels'])} wheels ({total / 2**20:.1f} MiB), manifest.json and run.sh to {args.dir}")
    print(f"on the GPU machine: bash {shlex.quote(str(args.dir))}/run.sh [CHECKOUT] [-- gpu_check arguments]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
