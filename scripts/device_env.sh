# Sourced (". scripts/device_env.sh") by a script that the device machine runs from the repository root: installs
# this tree into /tmp/ml and exports PYTHONPATH=/tmp/ml, PYTHONUNBUFFERED=1 and R (the checkout; run pytest from
# outside it, whose root holds a partial multilora/ that would shadow the install: "cd /tmp && pytest $R/tests/...").
# /tmp/ml is removed first: `pip install --target` leaves an existing install in place, and a machine still warm
# from the call before keeps that call's install (session 27: one call measured the tree before, unawares).
rm -rf /tmp/ml
if ! pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/tmp/device_env_pip.log 2>&1; then
    echo "device_env.sh: pip install of $PWD failed:" >&2
    tail -20 /tmp/device_env_pip.log >&2
    return 1 2>/dev/null || exit 1
fi
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1 R=$PWD
