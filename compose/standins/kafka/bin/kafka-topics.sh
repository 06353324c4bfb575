#!/usr/bin/env bash
# Kafka's kafka-topics.sh (a client tool: a small JVM that starts fast, as healthchecks call it).
export KAFKA_JVM_PERFORMANCE_OPTS=${KAFKA_JVM_PERFORMANCE_OPTS:--XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Xshare:auto}
exec "$(dirname "$0")/kafka-run-class.sh" org.apache.kafka.tools.TopicCommand "$@"
