package streamq

import (
	"context"
	"fmt"
	"sync"
)

// Send hands a request to the producer and returns before Redis has it:
// the fastest way to submit jobs when the caller does not need each one
// acknowledged, because requests from any number of calls share round trips
// (up to MaxBatchItems each) instead of each call waiting for its own.
//
// Durability: a nil error means only that the request is in this process's
// memory; a crash before its batch is written loses it, and a failure to
// write it is reported to ProducerOptions.OnSendError and by the next Flush,
// never to the caller of Send.
//
// Send validates and encodes the request like Enqueue (those errors are
// returned at once) and blocks, respecting ctx, only while MaxPendingBytes of
// requests wait to be written. It has Enqueue's deduplication. ctx bounds the
// call, not the write that follows. Close writes what Send accepted, within
// CloseTimeout. ProducerOptions.Interceptors run around the handover (their
// Outgoing.EntryID stays empty: the entry does not exist yet). A nil ctx
// panics.
func (p *Producer[Req, Resp]) Send(ctx context.Context, id string, req Req, opts ...ProduceOption) error {
	mustContext(ctx, "Producer.Send")
	if len(p.opts.Interceptors) == 0 {
		return p.send(ctx, id, req, opts, nil, false)
	}
	return p.intercept(ctx, []string{id}, [][]ProduceOption{opts}, func(ctx context.Context, outs []*Outgoing) error {
		h, set := headersOf(outs, 0)
		return p.send(ctx, id, req, opts, h, set)
	})
}

// send is Send inside the interceptors.
func (p *Producer[Req, Resp]) send(ctx context.Context, id string, req Req, opts []ProduceOption,
	headers map[string]string, headersSet bool) error {
	it, err := p.newItem(ctx, id, req, opts, headers, headersSet)
	if err != nil {
		return err
	}
	it.hush()
	if err := p.ensureMeta(ctx); err != nil {
		return err
	}
	if err := p.budget.acquire(ctx, p.closing, it.size()); err != nil {
		return err
	}
	// The write outlives the call: keep ctx's values, not its end.
	it.ctx = context.WithoutCancel(ctx)
	it.done = func(out produceOutcome) { p.sent(it.ctx, id, out) }
	p.sends.start()
	if err := p.hand(ctx, it); err != nil {
		p.budget.release(it.size())
		p.sends.finish(nil)
		return err
	}
	return nil
}

// Flush waits until every request Send accepted has been written to Redis or
// has failed, and returns an error counting the Sends that failed since the
// previous Flush (wrapping the first failure), or ctx's error. Sends made by
// other goroutines meanwhile are waited for too. A nil ctx panics.
func (p *Producer[Req, Resp]) Flush(ctx context.Context) error {
	mustContext(ctx, "Producer.Flush")
	return p.sends.wait(ctx)
}

// sent takes the outcome of one Send.
func (p *Producer[Req, Resp]) sent(ctx context.Context, id string, out produceOutcome) {
	err := out.err
	if err == nil && out.code == outcomeRejected {
		err = fmt.Errorf("%w: request %q: %s", ErrWrongType, id, out.data)
	}
	if err == nil && out.code == outcomeRefused {
		err = fmt.Errorf("%w: %s (request %q)", ErrInvalidOptions, out.data, id)
	}
	if err != nil {
		err = fmt.Errorf("streamq: send %q: %w", id, err)
		if p.opts.OnSendError != nil {
			p.opts.OnSendError(id, err)
		} else {
			p.log.ErrorContext(ctx, "streamq: a request accepted by Send was not written", "id", id, "err", err)
		}
	}
	p.sends.finish(err)
}

// sendTracker counts the Sends whose outcome is not known yet, and the
// failures since the last Flush.
type sendTracker struct {
	mu      sync.Mutex
	pending int
	idle    chan struct{} // closed when pending drops to 0; nil while it is 0
	failed  int
	first   error
}

func (s *sendTracker) start() {
	s.mu.Lock()
	if s.pending == 0 {
		s.idle = make(chan struct{})
	}
	s.pending++
	s.mu.Unlock()
}

func (s *sendTracker) finish(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil {
		s.failed++
		if s.first == nil {
			s.first = err
		}
	}
	s.pending--
	if s.pending == 0 {
		close(s.idle)
		s.idle = nil
	}
}

func (s *sendTracker) wait(ctx context.Context) error {
	s.mu.Lock()
	idle := s.idle
	s.mu.Unlock()
	if idle != nil {
		select {
		case <-idle:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	failed, first := s.failed, s.first
	s.failed, s.first = 0, nil
	if failed > 0 {
		return fmt.Errorf("streamq: %d sends failed since the last Flush; the first: %w", failed, first)
	}
	return nil
}
