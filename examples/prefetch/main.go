// Prefetch shows a consumer whose stream entries carry references, not
// payloads, and whose payloads are fetched ahead of the handler.
//
// An upstream service writes some request bodies into Redis cache keys; every
// body is also in an S3-like object store (here a small HTTP server on
// 127.0.0.1 that answers after a few milliseconds, as a real store would). A
// producer enqueues only the document names. The consumer uses a
// streamq.CacheFetcher: the cache key first, the object store on a miss, and
// the cache key deleted once the request's result is recorded. With Prefetch
// the fetches of the next messages overlap the handler of the current one.
//
// The run is done twice, with a prefetch depth of 1 (fetch, then handle, one
// at a time) and with a depth of 16, and prints where the payloads came from
// and how long each run took.
//
//	go run ./examples/prefetch
//
// Without REDIS_URL it starts an embedded Redis (miniredis) inside the
// process. With REDIS_URL (redis://host:port[/db]) it uses that server and
// deletes the keys it wrote.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/streamq/streamq"
	"github.com/streamq/streamq/examples/internal/exampleredis"
)

const (
	documents    = 120
	cacheEvery   = 3                    // the upstream caches every third document
	storeLatency = 4 * time.Millisecond // per object GET
	handlerWork  = 2 * time.Millisecond // per message
)

// Document is the request body.
type Document struct {
	Name string
	Text string
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "prefetch:", err)
		os.Exit(1)
	}
}

func run() error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	client, where, cleanup, err := exampleredis.Connect()
	if err != nil {
		return err
	}
	defer cleanup()

	store := newObjectStore(storeLatency)
	stopStore, err := store.serve()
	if err != nil {
		return err
	}
	defer stopStore()
	for i := range documents {
		name := docName(i)
		body, _ := json.Marshal(Document{Name: name, Text: strings.Repeat("lorem ipsum ", 5+i%7)})
		store.put(name, body)
	}
	fmt.Printf("Redis: %s; object store: http://%s (%v per GET); %d documents, 1 in %d cached upstream\n",
		where, store.addr, storeLatency, documents, cacheEvery)

	var results []result
	for _, depth := range []int{1, 16} {
		r, err := consumeAll(ctx, client, store, depth)
		if err != nil {
			return fmt.Errorf("depth %d: %w", depth, err)
		}
		fmt.Printf("depth %2d: %d messages in %v: %d payloads from the Redis cache, %d from the object store\n",
			depth, r.handled, r.elapsed.Round(time.Millisecond), r.fromCache, r.fromStore)
		results = append(results, r)
	}
	fmt.Printf("prefetch depth 16 took %.0f%% of the time of depth 1 (%.1fx faster)\n",
		100*float64(results[1].elapsed)/float64(results[0].elapsed),
		float64(results[0].elapsed)/float64(results[1].elapsed))
	return nil
}

type result struct {
	handled, fromCache, fromStore int
	elapsed                       time.Duration
}

// consumeAll runs one round on a queue of its own: the upstream caches some
// bodies, the producer enqueues every document's name, and a consumer with the
// given prefetch depth handles them all.
func consumeAll(ctx context.Context, client *redis.Client, store *objectStore, depth int) (result, error) {
	queue := fmt.Sprintf("prefetch-example-%d-%d", depth, time.Now().UnixNano())
	cacheKey := func(name string) string { return queue + ":body:" + name }
	defer func() {
		if err := exampleredis.DeleteQueue(context.Background(), client, queue); err != nil {
			fmt.Fprintln(os.Stderr, "prefetch: cleaning up:", err)
		}
	}()
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

	// The upstream service: writes the bodies of some documents into the cache
	// and hands their names on; the producer enqueues those and all the others.
	cached := make(chan string)
	upstreamErr := make(chan error, 1)
	go func() {
		defer close(cached)
		for i := 0; i < documents; i += cacheEvery {
			name := docName(i)
			body, _ := store.peek(name)
			if err := client.Set(ctx, cacheKey(name), body, 10*time.Minute).Err(); err != nil {
				upstreamErr <- err
				return
			}
			cached <- name
		}
		upstreamErr <- nil
	}()
	producer, err := streamq.NewProducer[[]byte, int](client, queue, &streamq.ProducerOptions{Logger: logger})
	if err != nil {
		return result{}, err
	}
	defer producer.Close()
	for name := range cached {
		// []byte requests bypass the codec: the entry holds the bare name.
		if err := producer.Enqueue(ctx, name, []byte(name)); err != nil {
			return result{}, err
		}
	}
	if err := <-upstreamErr; err != nil {
		return result{}, fmt.Errorf("upstream: %w", err)
	}
	for i := range documents {
		if i%cacheEvery != 0 {
			if err := producer.Enqueue(ctx, docName(i), []byte(docName(i))); err != nil {
				return result{}, err
			}
		}
	}

	source := &httpSource{base: "http://" + store.addr, client: &http.Client{Timeout: 5 * time.Second}}
	var handled atomic.Int64
	done := make(chan struct{})
	consumer, err := streamq.NewConsumer(client, queue,
		func(ctx context.Context, m *streamq.Message[Document]) (int, error) {
			if m.Payload.Name != m.ID {
				return 0, streamq.Permanent(fmt.Errorf("got the body of %q", m.Payload.Name))
			}
			time.Sleep(handlerWork) // the work
			if handled.Add(1) == documents {
				close(done)
			}
			return len(strings.Fields(m.Payload.Text)), nil
		},
		&streamq.ConsumerOptions{
			Workers:  1,
			Prefetch: depth,
			Fetcher: &streamq.CacheFetcher{
				Client:           client,
				CacheKey:         func(e streamq.Entry) string { return cacheKey(string(e.Data)) },
				Source:           source,
				DeleteOnComplete: true,
			},
			ReadBlock: 100 * time.Millisecond,
			Logger:    logger,
		})
	if err != nil {
		return result{}, err
	}
	runCtx, stop := context.WithCancel(ctx)
	runDone := make(chan error, 1)
	start := time.Now()
	go func() { runDone <- consumer.Run(runCtx) }()
	select {
	case <-done:
	case <-ctx.Done():
		stop()
		<-runDone
		return result{}, fmt.Errorf("handled %d of %d before the deadline", handled.Load(), documents)
	}
	elapsed := time.Since(start)
	stop()
	if err := <-runDone; err != nil {
		return result{}, err
	}

	// Run has flushed every completion: the cache keys are gone.
	left, err := client.Keys(ctx, queue+":body:*").Result()
	if err != nil {
		return result{}, err
	}
	if len(left) > 0 {
		return result{}, fmt.Errorf("%d cache keys left after completion", len(left))
	}
	fromStore := int(source.gets.Load())
	return result{handled: int(handled.Load()), fromCache: int(handled.Load()) - fromStore, fromStore: fromStore, elapsed: elapsed}, nil
}

func docName(i int) string { return fmt.Sprintf("doc-%03d", i) }

// objectStore is an in-memory, S3-like object store served over HTTP:
// GET /objects/<key> returns the object or 404, after a fixed latency.
type objectStore struct {
	latency time.Duration
	addr    string

	mu    sync.RWMutex
	blobs map[string][]byte
}

func newObjectStore(latency time.Duration) *objectStore {
	return &objectStore{latency: latency, blobs: map[string][]byte{}}
}

func (s *objectStore) put(key string, b []byte) {
	s.mu.Lock()
	s.blobs[key] = b
	s.mu.Unlock()
}

func (s *objectStore) peek(key string) ([]byte, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	b, ok := s.blobs[key]
	return b, ok
}

// serve listens on a loopback port and returns a function that stops the server.
func (s *objectStore) serve() (stop func(), err error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s.addr = ln.Addr().String()
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key, ok := strings.CutPrefix(r.URL.Path, "/objects/")
		if r.Method != http.MethodGet || !ok {
			http.Error(w, "not found", http.StatusNotFound)
			return
		}
		select {
		case <-time.After(s.latency):
		case <-r.Context().Done():
			return
		}
		b, ok := s.peek(key)
		if !ok {
			http.Error(w, "no such key", http.StatusNotFound)
			return
		}
		w.Header().Set("Content-Type", "application/octet-stream")
		_, _ = w.Write(b)
	}), ReadHeaderTimeout: 5 * time.Second}
	served := make(chan struct{})
	go func() {
		defer close(served)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			fmt.Fprintln(os.Stderr, "object store:", err)
		}
	}()
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
		<-served
	}, nil
}

// httpSource is a streamq.Source reading the object store over HTTP.
type httpSource struct {
	base   string
	client *http.Client
	gets   atomic.Int64
}

// errNotFound marks objects the store does not have.
var errNotFound = errors.New("object not found")

func (s *httpSource) Get(ctx context.Context, key string) ([]byte, error) {
	s.gets.Add(1)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.base+"/objects/"+key, nil)
	if err != nil {
		return nil, err
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusNotFound:
		return nil, fmt.Errorf("%w: %s", errNotFound, key)
	case resp.StatusCode != http.StatusOK:
		return nil, fmt.Errorf("GET %s: %s", key, resp.Status)
	}
	return io.ReadAll(resp.Body)
}
