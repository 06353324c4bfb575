#!/bin/sh
# /bin/prometheus: Debian's build with the official image's defaults. Debian patched the
# storage default to /var/lib/prometheus/metrics2/; the official binary keeps "data/"
# (under the image's WORKDIR /prometheus, its volume): given unless the command says.
case " $* " in
    *" --storage.tsdb.path"*) ;;
    *) set -- "$@" --storage.tsdb.path=data/ ;;
esac
exec /usr/lib/prometheus/prometheus "$@"
