#!/usr/bin/env bash
# The part of Kafka's kafka-run-class.sh the other scripts need: the JVM on Kafka's jars.
# KAFKA_HEAP_OPTS (default -Xmx256M, as Kafka's), KAFKA_JVM_PERFORMANCE_OPTS and KAFKA_OPTS
# as Kafka reads them; log4j 2 with the broker's configuration.
exec java ${KAFKA_HEAP_OPTS:--Xmx256M} \
    ${KAFKA_JVM_PERFORMANCE_OPTS:--XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent} \
    -Djava.awt.headless=true -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties \
    ${KAFKA_OPTS:-} -cp '/opt/kafka/libs/*' "$@"
