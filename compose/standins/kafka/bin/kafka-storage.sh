#!/usr/bin/env bash
# Kafka's kafka-storage.sh (format, info, random-uuid).
exec "$(dirname "$0")/kafka-run-class.sh" kafka.tools.StorageTool "$@"
