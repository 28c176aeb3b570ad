// An independently written Pulsar client (pulsar-flex: pure JavaScript, no C++ core) against
// tierstream's broker: a Key_Shared and an Exclusive consumer subscribe, a producer sends a
// batch and single messages with properties, each consumer receives and acknowledges all of
// them. Prints one JSON line per message received; exits 0 once each consumer has all.
// Usage: node roundtrip.js HOST:PORT TOPIC COUNT
const { Producer, Consumer, logLevel } = require('pulsar-flex');

const [server, topic, countText] = process.argv.slice(2);
const count = Number(countText);

const consume = async (subType, name) => {
  const consumer = new Consumer({
    topic, subscription: name, discoveryServers: [server], subType, consumerName: name,
    initialPosition: Consumer.INITIAL_POSITION.EARLIEST, receiveQueueSize: 100,
    logLevel: logLevel.ERROR,
  });
  await consumer.subscribe();
  let got = 0;
  const done = new Promise((resolve) => {
    consumer.run({
      autoAck: false,
      onMessage: async ({ ack, message, properties, redeliveryCount }) => {
        await ack();
        console.log(JSON.stringify({ consumer: name, value: message.toString(),
          properties, redeliveryCount }));
        got += 1;
        if (got === count) resolve();
      },
    });
  });
  return { consumer, done };
};

const run = async () => {
  const readers = [await consume(Consumer.SUB_TYPES.KEY_SHARED, 'flex-key-shared'),
    await consume(Consumer.SUB_TYPES.EXCLUSIVE, 'flex-exclusive')];
  const producer = new Producer({
    topic, discoveryServers: [server], producerAccessMode: Producer.ACCESS_MODES.SHARED,
    logLevel: logLevel.ERROR,
  });
  await producer.create();
  const half = Math.floor(count / 2);
  const batch = [];
  for (let i = 0; i < half; i += 1) batch.push({ payload: `m${i}`, properties: { i: `${i}` } });
  await producer.sendBatch({ messages: batch });
  for (let i = half; i < count; i += 1) {
    await producer.sendMessage({ payload: `m${i}`, properties: { i: `${i}` } });
  }
  await producer.close();
  await Promise.all(readers.map((r) => r.done));
  for (const r of readers) await r.consumer.unsubscribe();
};

run().then(() => process.exit(0)).catch((e) => { console.error(e); process.exit(1); });
