#!/bin/sh
# One-shot job for the temporalio/admin-tools image: wait until the cluster answers, then make sure the
# namespace and durastack's search attributes exist. Adds only what is missing, so it can run on every start.
#   TEMPORAL_ADDRESS   frontend, host:port
#   NAMESPACE          namespace durastack uses (DURASTACK_NAMESPACE of the workers)
#   RETENTION          retention of closed workflows when the namespace is created, e.g. 7d
#   SEARCH_ATTRIBUTES  space-separated Keyword attributes (models/settings.py SEARCH_ATTRIBUTES)
set -eu
: "${TEMPORAL_ADDRESS:?}" "${NAMESPACE:?}" "${SEARCH_ATTRIBUTES:?}"

tries=0
until temporal operator cluster health --address "$TEMPORAL_ADDRESS" >/dev/null 2>&1; do
    tries=$((tries + 1))
    if [ "$tries" -ge 60 ]; then
        echo "temporal at $TEMPORAL_ADDRESS is not healthy after $tries tries" >&2
        exit 1
    fi
    sleep 2
done

if ! temporal operator namespace describe --address "$TEMPORAL_ADDRESS" -n "$NAMESPACE" >/dev/null 2>&1; then
    temporal operator namespace create --address "$TEMPORAL_ADDRESS" -n "$NAMESPACE" --retention "${RETENTION:-7d}"
fi

# A namespace just created can take a moment to reach every frontend: retry the listing.
tries=0
until have=$(temporal operator search-attribute list --address "$TEMPORAL_ADDRESS" -n "$NAMESPACE" 2>/dev/null); do
    tries=$((tries + 1))
    [ "$tries" -lt 30 ] || { echo "cannot list search attributes of $NAMESPACE" >&2; exit 1; }
    sleep 2
done
for name in $SEARCH_ATTRIBUTES; do
    if printf '%s\n' "$have" | grep -qw "$name"; then
        echo "search attribute $name: present"
    else
        temporal operator search-attribute create --address "$TEMPORAL_ADDRESS" -n "$NAMESPACE" \
            --name "$name" --type Keyword
        echo "search attribute $name: created"
    fi
done
