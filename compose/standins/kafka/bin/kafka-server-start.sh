#!/usr/bin/env bash
# Kafka's kafka-server-start.sh: the broker on a server.properties (1 GB heap by default).
export KAFKA_HEAP_OPTS=${KAFKA_HEAP_OPTS:--Xmx1G -Xms1G}
exec "$(dirname "$0")/kafka-run-class.sh" kafka.Kafka "$@"
