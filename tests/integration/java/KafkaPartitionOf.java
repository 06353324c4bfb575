// The partition Kafka's own Java producer picks for a key, for tests that compare
// the relay's placement with it. Run from the Kafka jars (single-file source launch):
//
//   java -cp '.dev/kafka/libs/*' tests/integration/java/KafkaPartitionOf.java < lines
//
// Input: one "<partitions> <key as hex>" per line (hex, so any bytes pass; an empty
// hex field is the empty key). Output per line: "<Utils formula> <BuiltInPartitioner>",
// i.e. Utils.toPositive(Utils.murmur2(key)) % partitions, and the producer's own
// keyed-record partitioner, so the test also sees that the two agree.

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.HexFormat;
import org.apache.kafka.clients.producer.internals.BuiltInPartitioner;
import org.apache.kafka.common.utils.Utils;

public class KafkaPartitionOf {
    public static void main(String[] args) throws Exception {
        BufferedReader in =
                new BufferedReader(new InputStreamReader(System.in, StandardCharsets.US_ASCII));
        StringBuilder out = new StringBuilder();
        String line;
        while ((line = in.readLine()) != null) {
            if (line.isBlank()) {
                continue;
            }
            String[] fields = line.split(" ", -1);
            int partitions = Integer.parseInt(fields[0]);
            byte[] key = HexFormat.of().parseHex(fields.length > 1 ? fields[1] : "");
            int byUtils = Utils.toPositive(Utils.murmur2(key)) % partitions;
            int byProducer = BuiltInPartitioner.partitionForKey(key, partitions);
            out.append(byUtils).append(' ').append(byProducer).append('\n');
        }
        System.out.print(out);
    }
}
