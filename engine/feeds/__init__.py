"""engine/feeds"""
