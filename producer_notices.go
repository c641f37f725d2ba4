package streamq

// How outcomes reach waiting promises: the producer subscribes to the
// queue's completion channel, the listener resolves calls by the notices it
// receives, and the backstop reads the records of calls still waiting (a
// notice lost with a connection, say).
//
// Goroutines: one listener per shard (Producer.hearNotices), started by the
// first Produce or ProduceFlow, or when a caller first listens for an outcome
// (Promise.Wait, Done, Progress), and one backstop (Producer.backstop),
// started with them or by the first ProduceBatch.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/streamq/streamq/internal/keys"
	"github.com/streamq/streamq/internal/scripts"
)

// listen subscribes to the completion notices of every shard once, and
// starts the listeners. It returns after Redis confirmed the subscriptions,
// so no notice of a request appended afterwards can be missed; the records
// of those appended before are read then (see waiters).
func (p *Producer[Req, Resp]) listen(ctx context.Context) error {
	if p.subscribed.Load() {
		return nil // no method values to allocate
	}
	return p.await(ctx, &p.subTry, p.subscribed.Load, p.subscribe)
}

// listenFor is listen for a promise's Wait: it also returns, with nil, once
// the promise's call resolved (resolved) or the promise was released
// (released), which the Wait then reports, without waiting for the
// subscription attempt to end (up to setupTimeout when Redis does not
// confirm it).
func (p *Producer[Req, Resp]) listenFor(ctx context.Context, resolved, released <-chan struct{}) error {
	if p.subscribed.Load() {
		return nil
	}
	// Logged by the attempt: this Wait may leave before it ends.
	a, _, err := p.begin(&p.subTry, p.subscribed.Load, p.subscribeLogged)
	if a == nil {
		return err
	}
	select {
	case <-a.done:
		return a.err
	case <-resolved:
		return nil
	case <-released:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-p.closing:
		return ErrClosed
	}
}

// listenSoon starts subscribing, as listen does, without waiting for it (a
// Done or Progress, which have no ctx). A failed attempt that it started is
// logged, by the attempt itself; the backstop still resolves the calls
// (within BackstopInterval), and the next listen tries again.
func (p *Producer[Req, Resp]) listenSoon() {
	if p.subscribed.Load() {
		return
	}
	// An attempt in progress is joined, and its starter reports its error.
	_, _, _ = p.begin(&p.subTry, p.subscribed.Load, p.subscribeLogged)
}

// subscribeLogged is subscribe for an attempt nobody waits for: it logs its
// failure. (It runs in the attempt's goroutine, which begin counted in loops
// under setupMu: a goroutine of its own, counted after begin returned, could
// be added while Close waits for the loops.)
func (p *Producer[Req, Resp]) subscribeLogged(ctx context.Context) error {
	err := p.subscribe(ctx)
	if err != nil && p.lifetime.Err() == nil && !errors.Is(err, ErrClosed) {
		p.log.WarnContext(p.lifetime, "streamq: subscribing to completion notices failed; waiting promises are checked every BackstopInterval",
			"err", err)
	}
	return err
}

// ensureBackstop starts the backstop once (the first ProduceBatch of a
// producer that does not listen yet), so that promises nobody listens to
// still resolve (within BackstopInterval) and leave the map of waiters.
func (p *Producer[Req, Resp]) ensureBackstop() {
	if p.backstopOn.Load() {
		return
	}
	p.setupMu.Lock()
	defer p.setupMu.Unlock()
	if !p.stopping {
		p.startBackstop()
	}
}

// startBackstop starts the backstop unless it runs. setupMu is held, and
// Close has not begun stopping the goroutines.
func (p *Producer[Req, Resp]) startBackstop() {
	if p.backstopOn.Load() {
		return
	}
	p.loops.Add(1)
	go p.backstop()
	p.backstopOn.Store(true)
}

// kickBackstop asks the backstop for a check of every waiting request's
// record now.
func (p *Producer[Req, Resp]) kickBackstop() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// subscribe is one subscription attempt, run by await. Each PubSub is listed
// in trying while it waits for its confirmation, so that Close can close it
// (which ends a blocked read); the confirmation read is bounded by ctx's deadline.
func (p *Producer[Req, Resp]) subscribe(ctx context.Context) error {
	subs := make([]*redis.PubSub, 0, len(p.shards))
	fail := func(err error) error {
		p.setupMu.Lock()
		p.trying = nil
		p.setupMu.Unlock()
		for _, ps := range subs {
			_ = ps.Close()
		}
		return err
	}
	for _, k := range p.shards {
		// One subscription per shard: in a cluster each channel lives on its
		// shard's node (sharded pub/sub), and a subscription serves one node.
		var ps *redis.PubSub
		if p.sharded {
			ps = p.client.SSubscribe(ctx, k.Channel)
		} else {
			ps = p.client.Subscribe(ctx, k.Channel)
		}
		subs = append(subs, ps)
		p.setupMu.Lock()
		stopping := p.stopping
		p.trying = append(p.trying, ps)
		p.setupMu.Unlock()
		if stopping {
			return fail(ErrClosed)
		}
		if _, err := ps.Receive(ctx); err != nil {
			if errors.Is(err, context.DeadlineExceeded) && p.lifetime.Err() == nil {
				err = fmt.Errorf("not confirmed within %v: %w", setupTimeout, err)
			}
			return fail(fmt.Errorf("streamq: subscribe to %s: %w", k.Channel, channelPermission(err, p.queue, len(p.shards))))
		}
	}
	p.setupMu.Lock()
	defer p.setupMu.Unlock()
	p.trying = nil
	if p.stopping {
		for _, ps := range subs {
			_ = ps.Close()
		}
		return ErrClosed
	}
	p.subs = subs
	p.loops.Add(len(subs))
	for _, ps := range subs {
		go p.hearNotices(ps, ps.ChannelWithSubscriptions())
	}
	p.startBackstop()
	// Notices published from now on reach the listeners; the requests
	// appended before may have had theirs published to nobody.
	p.waiters.hear()
	p.subscribed.Store(true)
	p.kickBackstop()
	return nil
}

// hearNotices resolves promises from completion notices. It runs until Close.
func (p *Producer[Req, Resp]) hearNotices(ps *redis.PubSub, ch <-chan any) {
	defer p.loops.Done()
	for m := range ch {
		if h := p.testHookNotice.Load(); h != nil {
			(*h)()
		}
		switch m := m.(type) {
		case *redis.Message:
			if len(m.Payload) > 0 && m.Payload[0] == '~' {
				// A progress notice (progress.lua); completion notices start
				// with a digit.
				id, seq, v, err := parseProgressNotice(m.Payload[1:])
				if err != nil {
					p.log.WarnContext(p.lifetime, "streamq: ignoring a malformed progress notice", "err", err)
				} else {
					p.waiters.progress(id, seq, v)
				}
				continue
			}
			if err := parseNotice(m.Payload, p.waiters.resolveID); err != nil {
				p.log.WarnContext(p.lifetime, "streamq: ignoring a malformed completion notice", "err", err)
			}
		case *redis.Subscription:
			if m.Kind == "sunsubscribe" && p.lifetime.Err() == nil {
				// The node ended the subscription: it became a replica in a
				// cluster failover. It still relays the shard's notices as a
				// replica, so subscribe again (go-redis does not).
				if err := ps.SSubscribe(p.lifetime, m.Channel); err != nil && p.lifetime.Err() == nil {
					p.log.WarnContext(p.lifetime, "streamq: resubscribing to completion notices failed", "channel", m.Channel, "err", err)
				}
			}
			if m.Kind != "subscribe" && m.Kind != "ssubscribe" {
				continue
			}
			// A resubscription after a reconnect: notices may have been
			// lost, of requests appended before it and of those whose
			// append is marked after the check it asks for (hear).
			p.waiters.hear()
			p.kickBackstop()
		}
	}
}

// backstop periodically reads the records of waiting requests, recovering
// results whose notice was lost. It runs until Close. A failed check is
// retried after a short back-off (from backstopRetry, doubling up to
// BackstopInterval), not a full interval later: the check after a
// resubscription often meets a connection that is not usable yet, and a
// missed result must be found while its record lives (ResultTTL).
func (p *Producer[Req, Resp]) backstop() {
	defer p.loops.Done()
	t := time.NewTimer(p.opts.BackstopInterval)
	defer t.Stop()
	retry := time.Duration(0)
	for {
		select {
		case <-p.lifetime.Done():
			return
		case <-t.C:
		case <-p.kick:
		}
		next := p.opts.BackstopInterval
		if err := p.checkWaiting(p.lifetime); err != nil && p.lifetime.Err() == nil {
			p.slots.onError(err)
			retry = min(max(2*retry, backstopRetry), p.opts.BackstopInterval)
			next = retry
			p.log.WarnContext(p.lifetime, "streamq: backstop check failed; will retry", "err", err, "retry_in", retry)
		} else {
			retry = 0
		}
		if !t.Stop() {
			select {
			case <-t.C:
			default:
			}
		}
		t.Reset(next)
	}
}

// backstopRetry is the first delay before a failed record check is tried again.
const backstopRetry = 100 * time.Millisecond

// checkWaiting reads the records of every waiting request and resolves those
// that completed or vanished.
func (p *Producer[Req, Resp]) checkWaiting(ctx context.Context) error {
	byShard := make([][]string, len(p.shards))
	for _, id := range p.waiters.appendedIDs() {
		i := keys.ShardOf(id, len(p.shards))
		byShard[i] = append(byShard[i], id)
	}
	for shard, ids := range byShard {
		if err := p.checkRecords(ctx, p.shards[shard], ids); err != nil {
			return err
		}
	}
	// Progress notices lost with the subscription: the stored latest value,
	// for the requests whose promises listen (none: nothing read).
	for id, st := range p.waiters.progressListeners() {
		if err := p.readProgress(ctx, id, st); err != nil && !errors.Is(err, redis.Nil) {
			return err
		}
	}
	return nil
}

// checkRecords resolves the waiters of ids (all of one shard) whose records
// show an outcome or vanished. MGET keeps to one slot: the keys share a tag.
func (p *Producer[Req, Resp]) checkRecords(ctx context.Context, k keys.Keys, ids []string) error {
	const chunk = 256
	leftToNotice := false
	stillQuiet := false
	for len(ids) > 0 {
		n := min(chunk, len(ids))
		part := ids[:n]
		ids = ids[n:]
		names := make([]string, len(part))
		for i, id := range part {
			names[i] = k.Record(id)
		}
		vals, err := p.client.MGet(ctx, names...).Result()
		if err != nil {
			return err
		}
		// Quiet records (produced while this producer did not listen) are
		// announced from now on, once it listens: read again by the
		// script that changes them.
		var quiet []int
		if p.subscribed.Load() {
			for i, v := range vals {
				if s, ok := v.(string); ok && quietRecord(s) {
					quiet = append(quiet, i)
				}
			}
		}
		if len(quiet) > 0 {
			qnames := make([]string, len(quiet))
			for j, i := range quiet {
				qnames[j] = names[i]
			}
			heard, err := scripts.Hear.Run(ctx, p.client, qnames).Slice()
			if err != nil {
				return err
			}
			if len(heard) != len(quiet) {
				return fmt.Errorf("streamq: hear.lua answered %d records for %d keys", len(heard), len(quiet))
			}
			for j, i := range quiet {
				vals[i] = heard[j]
				if s, ok := heard[j].(string); ok && quietRecord(s) {
					stillQuiet = true // refused: Redis is at maxmemory
				}
			}
		}
		for i, v := range vals {
			s, ok := v.(string)
			switch {
			case !ok:
				p.waiters.resolveLost(part[i], p.opts.InflightTTL)
			case s == string(keys.RecordNoResult) && p.waiters.noticeDue(part[i], p.noticeGrace()):
				// The result is only in the notice, most likely on its
				// way to the listener: resolving now would give
				// ErrNoResult. A check after the grace decides.
				if !leftToNotice {
					leftToNotice = true
					time.AfterFunc(p.noticeGrace(), p.kickBackstop)
				}
			case len(s) > 0 && s[0] != keys.RecordInflight:
				p.waiters.resolveChecked(part[i], s)
			}
		}
	}
	if stillQuiet && !leftToNotice {
		// Redis refused to make them announced (maxmemory): their outcomes
		// come only from checks, so check again after the grace, not a
		// BackstopInterval later.
		time.AfterFunc(p.noticeGrace(), p.kickBackstop)
	}
	return nil
}

// quietRecord reports whether rec is a quiet record, "P<entry id>+", whose
// outcome will not be announced (see produce.lua).
func quietRecord(rec string) bool {
	return len(rec) > 2 && rec[0] == keys.RecordInflight && strings.IndexByte(rec, '+') == len(rec)-1
}

// noticeGrace is how long record checks leave a done marker without its
// result to the notice that carries the result (see waiters.noticeDue):
// BackstopInterval, at most a second.
func (p *Producer[Req, Resp]) noticeGrace() time.Duration {
	return min(p.opts.BackstopInterval, time.Second)
}

// parseNotice splits a completion notice ("<len>:<id><len>:<record>"...) and
// calls fn for each request.
func parseNotice(s string, fn func(id, record string)) error {
	next := func() (string, error) {
		colon := -1
		for i := 0; i < len(s) && i < 12; i++ {
			if s[i] == ':' {
				colon = i
				break
			}
		}
		if colon <= 0 {
			return "", errors.New("missing length prefix")
		}
		n, err := strconv.Atoi(s[:colon])
		if err != nil || n < 0 || colon+1+n > len(s) {
			return "", fmt.Errorf("bad length %q", s[:colon])
		}
		v := s[colon+1 : colon+1+n]
		s = s[colon+1+n:]
		return v, nil
	}
	for len(s) > 0 {
		id, err := next()
		if err != nil {
			return err
		}
		rec, err := next()
		if err != nil {
			return err
		}
		fn(id, rec)
	}
	return nil
}
